"""Routing state that router replicas share through Redis, next to the index.

* In-flight load: each replica counts the requests, prompt tokens and predicted uncached prompt
  tokens it has in flight per worker, in its own HASH, under a lease it renews every second
  (``lease.lua`` also rewrites the HASH from the replica's local truth, so a lost update heals
  within a lease period). Readers sum over replicas whose lease is alive (``inflight.lua``): a
  killed replica's load stops counting when its lease runs out and is deleted soon after.
* Expected prefixes: right after a routing decision, the prompt's blocks are remembered for a
  moment as "expected" on the chosen worker (``expect.lua``), so a burst of identical prompts
  sees the first one's choice before the engine's KV events reach the index.
* The learned cost model: each replica folds its batches of learned sums into one shared hash
  (``learn.lua``, driven by :mod:`router.routing.model_sync`).

Every Redis key and script call of the routers' own state goes through :class:`SharedLoad`;
the calls are declared in :mod:`kvindex.calls`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvindex import calls as lua
from kvindex.cluster import RedisClient
from kvindex.keys import KeySchema, ModelKeys, block_hex
from kvindex.scripts import ScriptCall, Scripts

LOAD_KINDS = ("r", "t", "u")
# A replica's in-flight hash expires this many lease periods after its last renewal (at least
# 10 s), so the hash of a killed replica goes by itself; its lease stops counting it long before.
HASH_EXPIRY_LEASES = 10
HASH_EXPIRY_MS = 60_000


@dataclass(frozen=True)
class InflightLoad:
    """One worker's in-flight load, summed over the live router replicas."""

    requests: int = 0
    prompt_tokens: int = 0
    uncached_tokens: int = 0
    # the attention work of those uncached tokens' prefills (router.routing.ttft_fit.attention_work):
    # prefill ahead after a long context takes longer than as many tokens cold
    attention: int = 0

    def __add__(self, other: InflightLoad) -> InflightLoad:
        return InflightLoad(
            self.requests + other.requests,
            self.prompt_tokens + other.prompt_tokens,
            self.uncached_tokens + other.uncached_tokens,
            self.attention + other.attention,
        )

    def __neg__(self) -> InflightLoad:
        return InflightLoad(-self.requests, -self.prompt_tokens, -self.uncached_tokens, -self.attention)

    def fields(self, worker_id: str) -> dict[str, int]:
        return {
            "r:" + worker_id: self.requests,
            "t:" + worker_id: self.prompt_tokens,
            "u:" + worker_id: self.uncached_tokens,
            "a:" + worker_id: self.attention,
        }


class Expectation(NamedTuple):
    """A decision's prompt blocks that ``worker_id`` is expected to hold once its prefill is done,
    until ``ttl_ms`` from now (expect.lua); with ``settled``, its prefill is over: where they are
    still expected there, at most ``ttl_ms`` more (settle.lua)."""

    model: str
    worker_id: str
    blocks: Sequence[int]
    ttl_ms: int
    settled: bool = False


def parse_totals(reply: Sequence[bytes | str]) -> dict[str, InflightLoad]:
    """inflight.lua's flat reply -> {worker id: load}."""
    parts: dict[str, dict[str, int]] = defaultdict(dict)
    for i in range(0, len(reply) - 1, 2):
        name = reply[i]
        field = name.decode() if isinstance(name, bytes) else str(name)
        kind, _, worker = field.partition(":")
        raw = reply[i + 1]
        value = raw.decode() if isinstance(raw, bytes) else str(raw)
        parts[worker][kind] = int(float(value))
    totals = {w: InflightLoad(p.get("r", 0), p.get("t", 0), p.get("u", 0), p.get("a", 0)) for w, p in parts.items()}
    return {w: load for w, load in totals.items() if load != InflightLoad()}


class SharedLoad:
    """One router replica's view of, and contribution to, the shared routing state."""

    def __init__(self, client: RedisClient, schema: KeySchema, replica_id: str, scripts: Scripts | None = None) -> None:
        self._client = client
        self._schema = schema
        self.replica_id = replica_id
        self._scripts = scripts or Scripts(client)
        self._live: dict[str, list[str]] = {}  # model -> live replica ids, from the last lease

    def keys(self, model: str) -> ModelKeys:
        return self._schema.for_model(model)

    def alone(self, model: str) -> bool:
        """True when this replica's last lease on ``model`` found no other live replica there: none
        reads its load from Redis now (a replica that starts is seen at the next renewal)."""
        live = self._live.get(model)
        return live is not None and all(replica == self.replica_id for replica in live)

    async def renew(self, model: str, ttl_ms: int, snapshot: Mapping[str, InflightLoad]) -> int:
        """Renew this replica's lease for ``model`` and rewrite its load from ``snapshot``."""
        keys = self.keys(model)
        pairs: list[str | int] = []
        for worker_id, load in snapshot.items():
            for field, value in load.fields(worker_id).items():
                if value > 0:
                    pairs += [field, value]
        expire_ms = max(ttl_ms * HASH_EXPIRY_LEASES, 10_000)
        removed, *live = await self._scripts.call(lua.lease(keys, self.replica_id, ttl_ms, expire_ms, pairs))
        self._live[model] = [r.decode() if isinstance(r, bytes) else str(r) for r in live]
        return int(removed)

    async def add(self, model: str, worker_id: str, delta: InflightLoad) -> None:
        await self.add_many({(model, worker_id): delta})

    async def totals(self, model: str) -> dict[str, InflightLoad]:
        """The summed load now, over the replicas live now (read first: an observer that never
        renews a lease knows of none); routing decisions use :meth:`totals_call` instead."""
        now, *leases = await self._scripts.call(lua.alive(self.keys(model).replicas, "all"))
        self._live[model] = [
            r.decode() if isinstance(r, bytes) else str(r)
            for r, deadline in zip(leases[::2], leases[1::2], strict=True)
            if float(deadline) > int(now)
        ]
        return parse_totals(await self._scripts.call(self.totals_call(model)))

    def totals_call(self, model: str, others_only: bool = False) -> ScriptCall[Any]:
        """inflight.lua over the replicas live at this replica's last lease (and itself, unless
        ``others_only``: a decision adds its own replica's load from its local truth, which is
        exact, where what Redis holds of it may be a flush behind or ahead). A new replica
        counts from this replica's next renewal, within a lease period."""
        keys = self.keys(model)
        replicas = list(dict.fromkeys([self.replica_id, *self._live.get(model, ())]))
        if others_only:
            replicas.remove(self.replica_id)
        return lua.inflight(keys, replicas)

    async def add_many(self, deltas: Mapping[tuple[str, str], InflightLoad]) -> None:
        """Several (model, worker) load changes in one round trip."""
        await self.write_many(deltas, [])

    async def write_many(self, deltas: Mapping[tuple[str, str], InflightLoad], expects: Sequence[Expectation]) -> None:
        """Load changes and expected prefixes (:meth:`write_calls`), all in one round trip."""
        calls = self.write_calls(deltas, expects)
        if calls:
            for result in await self._scripts.call_many(calls):
                if isinstance(result, Exception):
                    raise result

    def write_calls(
        self, deltas: Mapping[tuple[str, str], InflightLoad], expects: Sequence[Expectation]
    ) -> list[ScriptCall[Any]]:
        """Load changes (inflight_add.lua, one call per model) and expected prefixes
        (expect.lua) as script calls, for one batch."""
        per_model: dict[str, list[str | int]] = defaultdict(list)
        for (model, worker_id), delta in deltas.items():
            for field, value in delta.fields(worker_id).items():
                if value:
                    per_model[model] += [field, value]
        calls: list[ScriptCall[Any]] = [
            lua.inflight_add(self.keys(model), self.replica_id, HASH_EXPIRY_MS, pairs)
            for model, pairs in per_model.items()
        ]
        return calls + self._expect_calls(expects)

    async def learn(self, model: str, batch_id: str, forget_ms: int, expire_ms: int, rest: Sequence[str | int]) -> Any:
        """learn.lua: one batch of this replica's learned sums (``rest``: the fields to delete, then
        the quadruples) folded into the shared model; the model back, as the script returns it."""
        return await self._scripts.run(
            lua.learn(self.keys(model), self.replica_id, batch_id, forget_ms, expire_ms, rest)
        )

    async def leave(self, model: str) -> None:
        """Graceful shutdown: this replica's load stops counting at once."""
        keys = self.keys(model)
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.zrem(keys.replicas, self.replica_id)
            pipe.delete(keys.inflight(self.replica_id))
            await pipe.execute()

    async def expect(self, model: str, worker_id: str, blocks: Sequence[int], ttl_ms: int) -> None:
        if blocks:
            await self.expect_many([Expectation(model, worker_id, blocks, ttl_ms)])

    async def expect_many(self, entries: Sequence[Expectation]) -> None:
        """Remember several decisions' expected prefixes in one round trip."""
        await self.write_many({}, entries)

    def _expect_calls(self, entries: Sequence[Expectation]) -> list[ScriptCall[Any]]:
        return [
            lua.expect(self.keys(model), worker_id, ttl_ms, [block_hex(b) for b in blocks], settle=settled)
            for model, worker_id, blocks, ttl_ms, settled in entries
            if blocks
        ]

    async def expected(self, model: str, blocks: Sequence[int]) -> list[str | None]:
        """For each block, the worker it was just routed to (None: none, or lapsed)."""
        if not blocks:
            return []
        return parse_expected(await self._scripts.call(self.expected_call(model, blocks)))

    def expected_call(self, model: str, blocks: Sequence[int]) -> ScriptCall[Any]:
        return lua.expected(self.keys(model), [block_hex(b) for b in blocks])


def parse_expected(reply: Sequence[bytes | str | None]) -> list[str | None]:
    return [v.decode() if isinstance(v, bytes) else v for v in reply]
