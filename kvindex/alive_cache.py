"""A reader's copy of a model's alive gids, checked with a two-value reply per match.

Every match needs the gids alive now. Reading them whole (alive.lua) costs the control shard a
sorted-set range and a reply that grow with the fleet (131 us and 24 KB at 1,000 workers). The
scripts that change who is alive write a new ``alive_version`` (register, clear, swap, and a
heartbeat that revives a lapsed gid or lowers a deadline); a heartbeat that pushes a live
deadline later writes none. So a copy of version v, with each gid's deadline, is still exact
while the version is v and none of its deadlines has passed: a gid alive in the copy is alive
now (its deadline only moved later), and no gid joined. ``alive_since.lua`` checks both on the
server and answers ``{now, version}`` then, or the whole set when the copy no longer holds.

Even that script is ~15 us of the server's CPU, a tenth of a whole match's. So between scripts
a match confirms the copy by a plain ``GET`` of the version (~0.5 us), and the reader checks the
deadlines itself, against an upper bound of the server's clock: each script call carries the
reader's clock when it was built (a tag the script echoes), and ``now - tag`` bounds how far the
server's clock is ahead of the reader's (the call ran after it was built). A version confirmed
while that bound is short of the copy's refresh time is exact; a reply that arrives past it is
read again with the script (a second round trip, which a margin at build time makes rare).

A copy is also refreshed at least every :data:`MAX_AGE_MS`, so that a writer that does not
write versions (an agent of an older kvroute during an upgrade, a hand edit with redis-cli)
delays what readers see by at most that much.

Snapshots are immutable and kept by version, so calls built from one snapshot and answered
after another arrived are still read against the copy they were checked against. Pure: no I/O.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvindex import calls as lua
from kvindex.keys import ModelKeys
from kvindex.replies import decode
from kvindex.scripts import ScriptCall

MAX_AGE_MS = 1000
KEPT_SNAPSHOTS = 8  # per model: replies in flight across a refresh find the copy they were checked against
# A copy within this of its refresh time is confirmed by the script, not by its version alone:
# a version's reply that came later than that would need a second round trip.
CONFIRM_MARGIN_MS = 50


@dataclass(frozen=True)
class AliveSnapshot:
    """The alive gids of one version, with their deadlines (ms, server clock), read at ``read_ms``."""

    version: str
    deadlines: dict[int, float]
    read_ms: int

    @cached_property
    def _first_lapse_ms(self) -> float:
        # Gids already lapsed at the read stay lapsed until a heartbeat revives them, which
        # writes a new version: only the deadlines still ahead can end the copy.
        return min((d for d in self.deadlines.values() if d > self.read_ms), default=float("inf"))

    @cached_property
    def _alive_at_read(self) -> frozenset[int]:
        return frozenset(gid for gid, deadline in self.deadlines.items() if deadline > self.read_ms)

    @cached_property
    def refresh_before_ms(self) -> int:
        return int(min(self._first_lapse_ms, self.read_ms + MAX_AGE_MS))

    def alive_at(self, now_ms: int) -> frozenset[int]:
        """The gids alive at ``now_ms``: the same set (one object) for every time before the
        first deadline passes, which is every match while the copy holds."""
        if self.read_ms <= now_ms < self._first_lapse_ms:
            return self._alive_at_read
        return frozenset(gid for gid, deadline in self.deadlines.items() if deadline > now_ms)


def parse_snapshot(reply: list[Any]) -> AliveSnapshot:
    """alive_since.lua's whole reply ``{now, version, 'gid,deadline,...'}`` -> a snapshot."""
    now_ms, version, flat = int(reply[0]), decode(reply[1]), decode(reply[2])
    values = flat.split(",") if flat else []
    if len(values) % 2:
        raise ValueError(f"alive_since reply has {len(values)} values, not gid/deadline pairs")
    deadlines = {int(values[i]): float(values[i + 1]) for i in range(0, len(values), 2)}
    return AliveSnapshot(version, deadlines, now_ms)


class AliveCache:
    """The latest snapshots of each model's alive gids, for one reader (a router process).
    ``clock``: the reader's monotonic clock in seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._latest: dict[str, AliveSnapshot] = {}
        self._kept: dict[str, OrderedDict[str, AliveSnapshot]] = {}
        # Per model: (the tag of the latest script call answered, an upper bound in ms of the
        # server's clock minus this reader's then). The latest, not the least: a server whose
        # clock was set back (or a failover to another machine) is followed within MAX_AGE_MS.
        self._offsets: dict[str, tuple[float, float]] = {}

    def call(self, keys: ModelKeys) -> ScriptCall[Any]:
        """The call that checks this reader's latest copy of the model's gids: the version alone
        while the copy holds by the server's clock's bound, else alive_since.lua."""
        held = self._latest.get(keys.model)
        if held is None:
            return self.whole_call(keys)
        server_ms = self._server_ms(keys.model)
        if server_ms is not None and server_ms + CONFIRM_MARGIN_MS < held.refresh_before_ms:
            return lua.alive_version(keys)
        return lua.alive_since(keys, held.version, held.refresh_before_ms, self._tag())

    def whole_call(self, keys: ModelKeys) -> ScriptCall[Any]:
        """alive_since.lua for the whole set, whatever this reader holds."""
        return lua.alive_since(keys, "", 0, self._tag())  # refresh-before 0: the whole set, always

    def alive(self, model: str, reply: Any) -> frozenset[int] | None:
        """The gids alive when the reply was read (a script's reply, or the version alone);
        None when it confirms a copy this cache no longer keeps, or one that may have lapsed
        by then (read again with :meth:`whole_call`)."""
        if not isinstance(reply, list):  # the version alone (GET; absent: '')
            held = self._held(model, "" if reply is None else decode(reply))
            server_ms = self._server_ms(model)
            if held is None or server_ms is None or server_ms >= held.refresh_before_ms:
                return None
            return held.alive_at(int(server_ms))
        now_ms = int(reply[0])
        if len(reply) == 4:  # with the tag: {now, version, tag, whole set or nil}
            self._offset_from(model, now_ms, float(decode(reply[2])))
            reply = [reply[0], reply[1]] if reply[3] is None else [reply[0], reply[1], reply[3]]
        if len(reply) >= 3:
            snapshot = parse_snapshot(reply)
            self._keep(model, snapshot)
            return snapshot.alive_at(now_ms)
        held = self._held(model, decode(reply[1]))
        return None if held is None else held.alive_at(now_ms)

    def _tag(self) -> str:
        return repr(self._clock())

    def _held(self, model: str, version: str) -> AliveSnapshot | None:
        kept = self._kept.get(model)
        return None if kept is None else kept.get(version)

    def _offset_from(self, model: str, now_ms: int, asked_s: float) -> None:
        latest = self._offsets.get(model)
        if latest is None or asked_s >= latest[0]:
            self._offsets[model] = (asked_s, now_ms - 1000 * asked_s)

    def _server_ms(self, model: str) -> float | None:
        """An upper bound of the server's clock now (ms), from the latest tagged reply."""
        latest = self._offsets.get(model)
        return None if latest is None else latest[1] + 1000 * self._clock()

    def _keep(self, model: str, snapshot: AliveSnapshot) -> None:
        kept = self._kept.setdefault(model, OrderedDict())
        earlier = kept.get(snapshot.version)
        if earlier is not None:
            # One version, two reads: no gid joined or left in between and no deadline was
            # lowered, so each deadline either read is a true lower bound; keep the later one.
            # A reply checked against the earlier read then still finds every gid it held.
            merged = dict(earlier.deadlines)
            for gid, deadline in snapshot.deadlines.items():
                merged[gid] = max(deadline, merged.get(gid, deadline))
            snapshot = AliveSnapshot(snapshot.version, merged, max(snapshot.read_ms, earlier.read_ms))
        latest = self._latest.get(model)
        if latest is None or snapshot.read_ms >= latest.read_ms:
            self._latest[model] = snapshot
        kept[snapshot.version] = snapshot
        kept.move_to_end(snapshot.version)
        while len(kept) > KEPT_SNAPSHOTS:
            kept.popitem(last=False)
