"""``kvroute index ...``: the index as a person sees it (the same views as docs/index-schema.md's
redis-cli recipes), as tables or, with --json, as stable JSON for machines."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from kvindex.errors import KVIndexError
from kvindex.hashing import sequence_hashes
from kvindex.keys import KeySchema
from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings, redact_url


def parse_tokens(text: str) -> list[int]:
    """Token ids as '1,2,3' or a JSON list '[1, 2, 3]'."""
    raw = text.strip()
    try:
        values = json.loads(raw) if raw.startswith("[") else [int(v) for v in raw.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"token ids must be integers like 1,2,3: {exc}") from None
    if not isinstance(values, list) or not all(isinstance(v, int) and 0 <= v <= 0xFFFFFFFF for v in values):
        raise argparse.ArgumentTypeError("token ids must be integers in 0..4294967295")
    return values


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_parser(commands: Any) -> None:
    index = commands.add_parser("index", help="inspect the shared index", description=__doc__)
    sub = index.add_subparsers(dest="index_command", metavar="VIEW", required=True)

    def view(name: str, help_text: str, handler: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.set_defaults(handler=handler)
        return p

    def with_redis(p: argparse.ArgumentParser) -> None:
        p.add_argument("--redis-url", help="Redis URL (env KVROUTE_REDIS_URL; default redis://127.0.0.1:6379/0)")
        p.add_argument("--prefix", help="key prefix (env KVROUTE_PREFIX; default kvr)")

    def identity(p: argparse.ArgumentParser) -> None:
        p.add_argument("--tokens", type=parse_tokens, required=True, help="token ids: 1,2,3 or [1,2,3]")
        p.add_argument("--salt", help="the request's cache_salt")
        p.add_argument("--lora", help="the LoRA adapter name")

    p = view("hash", "block hashes of a token sequence (no Redis needed)", _run_hash)
    identity(p)
    p.add_argument("--block-size", type=positive_int, required=True)

    p = view("lookup", "who holds each block of a prompt, and each alive worker's match", _run_lookup)
    with_redis(p)
    p.add_argument("--model", required=True)
    identity(p)
    p.add_argument("--block-size", type=positive_int, help="default: the model's registered block size")

    p = view("workers", "registered workers, alive or not", _run_workers)
    with_redis(p)
    p.add_argument("--model", help="default: every model")

    p = view("stats", "size of the index per model", _run_stats)
    with_redis(p)
    p.add_argument("--model", help="default: every model")

    p = view("gc", "collect dead workers' entries now", _run_gc)
    with_redis(p)
    p.add_argument("--model", required=True)
    p.add_argument("--budget", type=positive_int, default=100_000, help="most entries to remove")
    p.add_argument("--grace-ms", type=int, default=30_000, help="how long past its TTL a worker counts as gone")


def _emit(args: argparse.Namespace, data: Any, table: Callable[[Any], str]) -> int:
    print(json.dumps(data) if args.json else table(data))
    return 0


def _run_with_index(args: argparse.Namespace, body: Callable[[RedisIndex], Awaitable[Any]]) -> Any:
    settings = RedisSettings.from_env(url=args.redis_url, prefix=args.prefix)

    async def run() -> Any:
        client = settings.client()
        try:
            return await body(RedisIndex(client, KeySchema(settings.prefix)))
        finally:
            await client.aclose()

    try:
        return asyncio.run(run())
    except RedisError as exc:
        print(f"kvroute: cannot use Redis at {redact_url(settings.url)}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except KVIndexError as exc:
        print(f"kvroute: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


def _run_hash(args: argparse.Namespace) -> int:
    hashes = sequence_hashes(args.tokens, args.block_size, lora_name=args.lora, cache_salt=args.salt)
    data = {"block_size": args.block_size, "hashes": hashes}
    return _emit(
        args, data, lambda d: _table(["index", "hash", "hex"], [[i, h, f"{h:016x}"] for i, h in enumerate(d["hashes"])])
    )


def _run_lookup(args: argparse.Namespace) -> int:
    async def body(index: RedisIndex) -> dict[str, Any]:
        block_size = args.block_size or await index.block_size(args.model)
        if block_size is None:
            raise KVIndexError(f"model {args.model!r} has no registered workers; pass --block-size")
        chain = sequence_hashes(args.tokens, block_size, lora_name=args.lora, cache_salt=args.salt)
        owners = await index.owners_of_chain(args.model, chain)
        matches = await index.match(args.model, chain)
        keys = index.keys(args.model)
        return {
            "model": args.model,
            "block_size": block_size,
            "blocks": [
                {"index": i, "hash": h, "key": keys.block(h), "owners": sorted(owners[i])} for i, h in enumerate(chain)
            ],
            "workers": [
                {"id": w, "matched_blocks": m} for w, m in sorted(matches.items(), key=lambda kv: (-kv[1], kv[0]))
            ],
        }

    def table(d: dict[str, Any]) -> str:
        blocks = _table(
            ["block", "hash", "owners"],
            [[b["index"], f"{b['hash']:016x}", ",".join(b["owners"]) or "-"] for b in d["blocks"]],
        )
        workers = _table(["worker", "matched_blocks"], [[w["id"], w["matched_blocks"]] for w in d["workers"]])
        return f"model {d['model']}, block size {d['block_size']}, {len(d['blocks'])} blocks\n\n{blocks}\n\n{workers}"

    return _emit(args, _run_with_index(args, body), table)


def _record_json(record: Any) -> dict[str, Any]:
    return {
        "id": record.worker_id, "model": record.model, "url": record.url, "alive": record.alive,
        "blocks": record.blocks, "block_size": record.block_size, "dp_rank": record.dp_rank,
        "gid": record.gid, "epoch": record.epoch, "heartbeat_age_ms": record.heartbeat_age_ms,
        "ttl_ms": record.ttl_ms,
        "running": record.load.running if record.load else None,
        "waiting": record.load.waiting if record.load else None,
        "kv_usage": record.load.kv_usage if record.load else None,
        "load_age_ms": record.load_age_ms,
    }  # fmt: skip


def _run_workers(args: argparse.Namespace) -> int:
    async def body(index: RedisIndex) -> list[dict[str, Any]]:
        models = [args.model] if args.model else await index.models()
        return [_record_json(r) for model in models for r in await index.workers(model)]

    headers = ["model", "id", "url", "alive", "blocks", "block_size", "dp_rank", "gid", "epoch", "heartbeat_age_ms",
               "running", "waiting", "kv_usage"]  # fmt: skip
    return _emit(args, _run_with_index(args, body), lambda d: _table(headers, [[w[h] for h in headers] for w in d]))


def _run_stats(args: argparse.Namespace) -> int:
    async def body(index: RedisIndex) -> dict[str, Any]:
        models = [args.model] if args.model else await index.models()
        out = [vars(await index.stats(m)) for m in models]
        return {
            "models": [{k: v for k, v in s.items() if k != "extra"} for s in out],
            "redis": await index.server_memory(),
        }

    def table(d: dict[str, Any]) -> str:
        headers = ["model", "block_size", "workers", "alive_workers", "entries", "block_keys", "gids_pending_gc"]
        mem = d["redis"]
        return _table(headers, [[s[h] for h in headers] for s in d["models"]]) + (
            f"\n\nRedis used_memory {mem['used_memory']} bytes, {mem['keys']} keys in the database"
        )

    return _emit(args, _run_with_index(args, body), table)


def _run_gc(args: argparse.Namespace) -> int:
    async def body(index: RedisIndex) -> dict[str, Any]:
        return vars(await index.gc(args.model, budget=args.budget, grace_ms=args.grace_ms))

    return _emit(args, _run_with_index(args, body), lambda d: _table(list(d), [list(d.values())]))
