"""The routing port (kvindex.routing_index) on Redis: the index's match, the other replicas' load
and the expected prefixes in one batch, on a single server one pipelined round trip.

On a single server the batch also carries the replica's pending load changes (no flush of their
own) and may be abandoned mid-flight for free: :mod:`kvindex.pipelined` reads every reply whoever
waits for it, and a :class:`~kvindex.pipelined.WireWatch` in the caller's context learns when they
are read (the router holds a lookup slot until then). On a cluster each shard gets its own batch
and nothing is carried.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from functools import partial
from typing import Any

from kvindex.pipelined import WireWatch, wire_watch
from kvindex.redis_index import RedisIndex
from kvindex.routing_index import IndexView, LoadCarrier
from kvindex.scripts import ScriptCall
from kvindex.shared_load import SharedLoad, parse_expected, parse_totals
from kvindex.types import WorkerRecord


class RedisRoutingIndex:
    """The router's view of the Redis index and of the replicas' shared state in Redis."""

    def __init__(self, index: RedisIndex, shared: SharedLoad) -> None:
        self.index = index
        self.shared = shared

    @property
    def cancel_safe(self) -> bool:
        return self.index.scripts.cancel_safe

    async def lookup(
        self,
        model: str,
        chain: Sequence[int],
        checkpoints: Sequence[int] = (),
        carrier: LoadCarrier | None = None,
    ) -> IndexView:
        calls = self.index.match_calls(model, chain)
        if self.shared.alone(model):
            # No other replica books load or expects prefixes here (a replica that starts is
            # seen at this one's next renewal): the index is all there is to read.
            replies = await self._call_carrying(calls, carrier)
            return IndexView(await self.index.match_result(model, chain, replies), {}, {})
        *replies, totals_reply, expected_reply = await self._call_carrying(
            [
                *calls,
                self.shared.totals_call(model, others_only=True),
                self.shared.expected_call(model, [chain[d - 1] for d in checkpoints]),
            ],
            carrier,
        )
        for reply in (totals_reply, expected_reply):
            if isinstance(reply, Exception):
                raise reply
        matches = await self.index.match_result(model, chain, replies)
        expected_depth: dict[str, int] = defaultdict(int)
        for depth, worker_id in zip(checkpoints, parse_expected(expected_reply), strict=True):
            if worker_id is not None:
                expected_depth[worker_id] = max(expected_depth[worker_id], depth)
        return IndexView(matches, parse_totals(totals_reply), expected_depth)

    async def _call_carrying(self, calls: list[ScriptCall[Any]], carrier: LoadCarrier | None) -> list[Any]:
        """``calls``' replies, the batch also carrying ``carrier``'s pending load changes where its
        replies are read whoever waits: a single server's pipelined connection. The carried
        writes' replies go to the carrier once read, even past the caller's budget."""
        scripts = self.index.scripts
        pending = carrier.carry() if carrier is not None and scripts.cancel_safe else None
        carried = self.shared.write_calls(*pending) if pending is not None else []
        if not carried:
            if pending is not None and carrier is not None:
                carrier.carried([])
            return await scripts.call_many(calls)
        assert carrier is not None
        watch = _RelayedWatch(wire_watch.get())
        token = wire_watch.set(watch)
        replies: list[Any] | None = None
        try:
            replies = await scripts.call_many([*calls, *carried])
            return replies[: len(calls)]
        finally:
            wire_watch.reset(token)
            done = partial(carrier.carried, replies[len(calls) :] if replies is not None else None)
            if watch.pending == 0:  # every reply read (or nothing sent: the batch's load is not written)
                done()
            else:  # given up while its replies are on the wire: done when they are read
                watch.on_settled = done

    async def group_holders(self, model: str, names: Sequence[int]) -> list[set[str]]:
        return await self.index.group_holders(model, names)

    async def workers(self, model: str) -> list[WorkerRecord]:
        return await self.index.workers(model)

    async def models(self) -> list[str]:
        return await self.index.models()


class _RelayedWatch(WireWatch):
    """Counts a batch's requests on the wire, and passes each on to the decision's own watch
    (the router's lookup slot is held until that one is settled)."""

    def __init__(self, outer: WireWatch | None) -> None:
        super().__init__()
        self._outer = outer

    def sent(self) -> None:
        super().sent()
        if self._outer is not None:
            self._outer.sent()

    def read(self) -> None:
        if self._outer is not None:
            self._outer.read()
        super().read()
