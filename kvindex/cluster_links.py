"""Script calls to a Redis Cluster's nodes over one pipelined connection each (kvindex.pipelined).

redis-py's cluster pipeline takes ~10 us of Python per command (it encodes every argument, looks
up each command's node and keeps a record per command): a 512-block match is 7 calls and ~80
arguments, ~1 ms of a router's CPU. Here a batch's calls are routed by their first key (kvroute's
scripts declare keys of one slot), packed by the caller in one pass per call, and written to each
node they go to at once; the replies of every node are awaited together, with no task each.

The slot map is redis-py's own (``nodes_manager``): what it learns from MOVED replies and
failovers is used here too. This module never follows a redirection or retries: a call that
meets MOVED, ASK, TRYAGAIN or a lost connection is left with that error as its result, and
:class:`kvindex.scripts.Scripts` sends it again through the cluster client, which does. Where a
node's connections are of a kind :mod:`kvindex.pipelined` does not take over, or the client has
no slot map yet, :meth:`ClusterLinks.round_trip` answers None and the caller uses redis-py's
pipeline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from kvindex.calls import ScriptCall
from kvindex.pipelined import PipelinedConnection

Pack = Callable[[PipelinedConnection, Sequence[ScriptCall[Any]]], list[bytes]]


class ClusterLinks:
    """A pipelined connection per cluster node, opened on first use."""

    def __init__(self, client: RedisCluster) -> None:
        self._client = client
        self._links: dict[str, PipelinedConnection | None] = {}  # by node name; None: not taken over

    def _replica_reads(self) -> tuple[bool, Any]:
        client = self._client
        strategy = getattr(client, "load_balancing_strategy", None)
        return bool(getattr(client, "read_from_replicas", False)) or strategy is not None, strategy

    def _route(self, calls: Sequence[ScriptCall[Any]]) -> dict[str, tuple[PipelinedConnection, list[int]]] | None:
        """The calls' positions by the node their first key's slot is served by (a replica for a
        read-only call where the client reads replicas); None where any cannot be routed here."""
        nodes = getattr(self._client, "nodes_manager", None)
        if nodes is None or not getattr(nodes, "slots_cache", None):
            return None  # not initialized yet (redis-py's pipeline does that), or a redis-py without it
        replicas, strategy = self._replica_reads()
        groups: dict[str, tuple[PipelinedConnection, list[int]]] = {}
        for i, call in enumerate(calls):
            if not call.keys:
                return None
            replica = replicas and call.spec.read_only
            try:
                node = nodes.get_node_from_slot(
                    self._client.keyslot(call.keys[0]), replica, strategy if replica else None
                )
            except (RedisError, RedisClusterException, TypeError):  # a slot no node serves now; another API
                return None
            group = groups.get(node.name)
            if group is None:
                link = self._link(node)
                if link is None:
                    return None
                group = groups[node.name] = (link, [])
            group[1].append(i)
        return groups

    def _link(self, node: Any) -> PipelinedConnection | None:
        if node.name not in self._links:
            self._links[node.name] = PipelinedConnection.for_node(node)
        return self._links[node.name]

    async def round_trip(self, calls: Sequence[ScriptCall[Any]], pack: Pack) -> list[Any] | None:
        """Each call's reply (error replies and connection errors as exception objects), the
        nodes at once; None where the calls cannot go this way (see the module's notes)."""
        groups = self._route(calls)
        if groups is None:
            return None
        waits = []
        for link, positions in groups.values():
            commands = pack(link, [calls[i] for i in positions])
            sent = link.send_now(commands, len(positions))
            if sent is None:  # the node's connection is opened first
                sent = asyncio.ensure_future(link.execute(commands, len(positions)))
                sent.add_done_callback(_retrieved)
            waits.append((positions, sent))
        results: list[Any] = [None] * len(calls)
        for positions, sent in waits:
            try:
                replies = await sent
            except RedisError as exc:  # the node's connection failed: each call is sent again
                replies = [exc] * len(positions)
            for i, reply in zip(positions, replies, strict=True):
                results[i] = reply
        return results

    async def aclose(self) -> None:
        links = [link for link in self._links.values() if link is not None]
        self._links.clear()
        for link in links:
            await link.aclose()


def _retrieved(sent: asyncio.Future[Any]) -> None:
    """A node's first request, whose caller stopped waiting: its failure is no one's to raise."""
    if not sent.cancelled():
        sent.exception()
