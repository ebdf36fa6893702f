"""The index interface that both backends implement (in the spirit of llm-d's kvblock.Index).

* :class:`kvindex.reference.ReferenceIndex` - in memory, naive and obviously right; it decides
  what the right answer is.
* :class:`kvindex.redis_index.RedisIndex` - the shared index in Redis that routers use.

Semantics: a worker registers and is alive while its heartbeats keep arriving within their TTL.
Only the client that registered a worker writes to it: ``register`` returns a
:class:`WorkerHandle`, the one owner of that registration's writer state, whose methods are the
worker's writes (``handle(model, worker_id)`` finds it again). A handle closes when its worker is
deregistered, or registered again through the same index.
``match`` returns, for every alive worker of the model, how many leading blocks of the chain it
holds (a run from block 0). Clearing or re-registering a worker starts it empty; a dead worker's
blocks never count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvindex.types import (
    BlockChange,
    GcResult,
    HeartbeatStatus,
    ModelStats,
    Registration,
    StoredRun,
    WorkerInfo,
    WorkerLoad,
    WorkerRecord,
    WriteResult,
)

DEFAULT_TTL_MS = 5_000
DEFAULT_GC_BUDGET = 10_000
DEFAULT_GC_GRACE_MS = 30_000


class WorkerHandle(Protocol):
    """One registration of one worker, as :meth:`KVIndex.register` returns it."""

    @property
    def info(self) -> WorkerInfo: ...

    @property
    def registration(self) -> Registration:
        """The current gid (it changes with ``clear``) and the epoch of this registration."""
        ...

    @property
    def active(self) -> bool:
        """False once deregistered, evicted, or registered again through the same index; the
        writes below then raise :class:`~kvindex.errors.NotRegisteredError`."""
        ...

    async def store(self, runs: Sequence[StoredRun]) -> WriteResult: ...

    async def remove(self, blocks: Sequence[int]) -> WriteResult: ...

    async def apply(self, changes: Sequence[BlockChange]) -> WriteResult:
        """Stores and removals in order, as one atomic step for readers."""
        ...

    async def clear(self) -> None: ...

    async def heartbeat(self, ttl_ms: int | None = None) -> HeartbeatStatus:
        """``ttl_ms`` None: the TTL the worker registered with (or was last given)."""
        ...

    async def report_load(self, load: WorkerLoad) -> HeartbeatStatus: ...

    async def set_adapters(self, adapters: Sequence[str]) -> HeartbeatStatus:
        """The LoRA adapters the worker's engine serves now (they load and unload at run time)."""
        ...

    async def set_kv_groups(self, kv_groups: str) -> HeartbeatStatus:
        """The engine's KV-cache groups (kvindex.groups.format_groups), once its events name them."""
        ...

    async def deregister(self) -> None: ...


class KVIndex(Protocol):
    async def register(self, worker: WorkerInfo, ttl_ms: int = DEFAULT_TTL_MS) -> WorkerHandle: ...

    def handle(self, model: str, worker_id: str) -> WorkerHandle:
        """The open handle of a worker registered through this index
        (:class:`~kvindex.errors.NotRegisteredError` otherwise)."""
        ...

    async def match(self, model: str, chain: Sequence[int]) -> dict[str, int]: ...

    async def group_holders(self, model: str, names: Sequence[int]) -> list[set[str]]:
        """Per name, the alive workers that hold it: a hybrid model's window-group blocks, kept as
        one-block chains (kvindex/groups.py)."""
        ...

    async def owners(self, model: str, block: int, chain: Sequence[int] | None = None) -> dict[str, int]:
        """Alive workers that hold ``block`` and its ancestors, each with 1. ``chain``, the block's
        chain from its first block through it, is how a paged backend finds the block (the Redis
        index needs it)."""
        ...

    async def workers(self, model: str) -> list[WorkerRecord]: ...

    async def block_size(self, model: str) -> int | None: ...

    async def models(self) -> list[str]: ...

    async def stats(self, model: str) -> ModelStats: ...

    async def gc(
        self, model: str, budget: int = DEFAULT_GC_BUDGET, grace_ms: int = DEFAULT_GC_GRACE_MS
    ) -> GcResult: ...
