"""Turning Redis and script replies into Python values (pure functions, no I/O)."""

from __future__ import annotations

from typing import NoReturn

from redis.exceptions import ResponseError

from kvindex.errors import BlockSizeMismatchError, ScriptArgumentError, StaleGenerationError
from kvindex.roles import BOTH
from kvindex.types import WorkerLoad, WorkerRecord


def raise_script_error(exc: ResponseError) -> NoReturn:
    """A script's ``kvroute:`` error as the :mod:`kvindex.errors` exception it stands for;
    any other error as it is."""
    message = str(exc)
    if "kvroute:" not in message:
        raise exc
    text = message[message.index("kvroute:") :]
    if "block size mismatch" in text:
        raise BlockSizeMismatchError(text) from None
    if "stale generation" in text:
        raise StaleGenerationError(text) from None
    raise ScriptArgumentError(text) from None


def decode(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


def time_ms(server_time: tuple[int, int]) -> int:
    """Redis TIME (seconds, microseconds) in ms: the clock the scripts use for deadlines."""
    seconds, micros = server_time
    return seconds * 1000 + micros // 1000


def load_of(record: dict[str, str]) -> WorkerLoad | None:
    if "load_ms" not in record:
        return None
    capacity = record.get("capacity_blocks")
    return WorkerLoad(
        int(record["running"]),
        int(record["waiting"]),
        float(record["kv_usage"]),
        int(capacity) if capacity else None,
    )


def worker_record(record: dict[str, str], deadlines: dict[int, float], now_ms: int) -> WorkerRecord:
    """A worker's record HASH (decoded) -> WorkerRecord, alive by the ``alive`` deadlines."""
    gid = int(record["gid"])
    return WorkerRecord(
        worker_id=record["id"],
        model=record["model"],
        url=record["url"],
        block_size=int(record["block_size"]),
        dp_rank=int(record["dp_rank"]),
        gid=gid,
        epoch=int(record["epoch"]),
        alive=deadlines.get(gid, 0) > now_ms,
        blocks=int(record["blocks"]),
        heartbeat_age_ms=now_ms - int(record["heartbeat_ms"]),
        ttl_ms=int(record["ttl_ms"]),
        load=load_of(record),
        load_age_ms=now_ms - int(record["load_ms"]) if "load_ms" in record else None,
        adapters=tuple(name for name in record.get("adapters", "").split("\n") if name),
        tier=record.get("tier") or "GPU",
        tier_of=record.get("tier_of") or None,
        role=record.get("role") or BOTH,  # records written before roles: both
        kv_groups=record.get("kv_groups", ""),
        max_model_len=int(record.get("max_model_len") or 0) or None,  # records before it: unknown
        engine_kind=record.get("engine_kind") or None,
    )
