"""Plain data shared by both index backends and their callers."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from kvindex.roles import ROLES


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker registers: where routers reach it and how its cache is cut into blocks."""

    worker_id: str
    model: str
    url: str
    block_size: int
    dp_rank: int = 0
    adapters: tuple[str, ...] = ()  # the LoRA adapters its engine serves (requests name them as the model)
    tier: str = "GPU"  # a tier holder's tier (kvindex/tiers.py); GPU: the worker's own blocks
    tier_of: str | None = None  # a tier holder's worker
    role: str = "both"  # its part in a prefill/decode split (kvindex/roles.py)
    max_model_len: int = 0  # its engine's context length, prompt and reply (0: unknown)
    engine_kind: str = ""  # how its agent reads the engine: vllm, sglang, trtllm ('': not said)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"a worker's role is one of {', '.join(ROLES)}, got {self.role!r}")
        if self.max_model_len < 0:
            raise ValueError(f"a worker's max_model_len is 0 (unknown) or more, got {self.max_model_len}")


@dataclass(frozen=True)
class StoredRun:
    """Consecutive blocks stored together; ``parent`` is the hash of the block before the first
    one, or None when the run starts a chain (block 0)."""

    parent: int | None
    hashes: tuple[int, ...]


@dataclass(frozen=True)
class RemovedBlocks:
    """Blocks that lost one copy each (one engine BlockRemoved per copy)."""

    hashes: tuple[int, ...]


# One ordered change to a worker's cached blocks; a batch of them is applied atomically.
BlockChange = StoredRun | RemovedBlocks


@dataclass(frozen=True)
class WorkerLoad:
    """The engine's own load signal, scraped from its /metrics by the agent."""

    running: int
    waiting: int
    kv_usage: float  # 0..1
    capacity_blocks: int | None = None  # the engine's KV-cache size in blocks (num_gpu_blocks)


@dataclass(frozen=True)
class Registration:
    gid: int
    epoch: int


class HeartbeatStatus(StrEnum):
    OK = "ok"
    MISSING = "missing"  # the record is gone: register again and re-assert
    SUPERSEDED = "superseded"  # another registration of this worker id took over


@dataclass(frozen=True)
class WriteResult:
    """What a store or remove did. ``skipped``: stored blocks whose chain start is unknown to the
    worker (not indexed until the ancestor arrives); ``missing``: removed blocks it did not hold."""

    applied: int = 0
    skipped: int = 0
    missing: int = 0

    def __add__(self, other: WriteResult) -> WriteResult:
        return WriteResult(self.applied + other.applied, self.skipped + other.skipped, self.missing + other.missing)


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    model: str
    url: str
    block_size: int
    dp_rank: int
    gid: int
    epoch: int
    alive: bool
    blocks: int
    heartbeat_age_ms: int
    ttl_ms: int
    load: WorkerLoad | None = None
    load_age_ms: int | None = None
    adapters: tuple[str, ...] = ()
    tier: str = "GPU"
    tier_of: str | None = None
    role: str = "both"  # its part in a prefill/decode split (kvindex/roles.py)
    kv_groups: str = ""  # a hybrid model's KV-cache groups (kvindex.groups.format_groups; '' for one group)
    max_model_len: int | None = None  # its engine's context length (None: not known)
    engine_kind: str | None = None  # how its agent reads the engine (None: not said)


@dataclass(frozen=True)
class GcResult:
    workers_retired: int
    entries_removed: int
    gids_finished: int
    gids_pending: int


@dataclass(frozen=True)
class ModelStats:
    model: str
    block_size: int | None
    workers: int
    alive_workers: int
    entries: int
    block_keys: int  # the layout before pages: its block keys (gc takes them down after an upgrade)
    gids_pending_gc: int
    extra: dict[str, int] = field(default_factory=dict)
    pages: int = 0  # pages with at least one holder (kvindex.pages)


def adapter_names(names: Iterable[str]) -> tuple[str, ...]:
    """LoRA adapter names as the index keeps them: sorted, each once; a ValueError for a name that
    is empty or not one line (the records keep them one per line)."""
    for name in names:
        if not isinstance(name, str) or not name or "\n" in name:
            raise ValueError(f"an adapter name must be non-empty and on one line, got {name!r}")
    return tuple(sorted(set(names)))
