"""A reader's copy of a model's alive gids, checked with a two-value reply per match.

Every match needs the gids alive now. Reading them whole (alive.lua) costs the control shard a
sorted-set range and a reply that grow with the fleet (131 us and 24 KB at 1,000 workers). The
scripts that change who is alive write a new ``alive_version`` (register, clear, swap, and a
heartbeat that revives a lapsed gid or lowers a deadline); a heartbeat that pushes a live
deadline later writes none. So a copy of version v, with each gid's deadline, is still exact
while the version is v and none of its deadlines has passed: a gid alive in the copy is alive
now (its deadline only moved later), and no gid joined. ``alive_since.lua`` checks both on the
server and answers ``{now, version}`` then, or the whole set when the copy no longer holds.

A copy is also refreshed at least every :data:`MAX_AGE_MS`, so that a writer that does not
write versions (an agent of an older kvroute during an upgrade, a hand edit with redis-cli)
delays what readers see by at most that much.

Snapshots are immutable and kept by version, so calls built from one snapshot and answered
after another arrived are still read against the copy they were checked against. Pure: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvindex import calls as lua
from kvindex.keys import ModelKeys
from kvindex.replies import decode
from kvindex.scripts import ScriptCall

MAX_AGE_MS = 1000
KEPT_SNAPSHOTS = 8  # per model: replies in flight across a refresh find the copy they were checked against


@dataclass(frozen=True)
class AliveSnapshot:
    """The alive gids of one version, with their deadlines (ms, server clock), read at ``read_ms``."""

    version: str
    deadlines: dict[int, float]
    read_ms: int

    @property
    def refresh_before_ms(self) -> int:
        # Gids already lapsed at the read stay lapsed until a heartbeat revives them, which
        # writes a new version: only the deadlines still ahead can end the copy.
        earliest = min((d for d in self.deadlines.values() if d > self.read_ms), default=float("inf"))
        return int(min(earliest, self.read_ms + MAX_AGE_MS))

    def alive_at(self, now_ms: int) -> set[int]:
        return {gid for gid, deadline in self.deadlines.items() if deadline > now_ms}


def parse_snapshot(reply: list[Any]) -> AliveSnapshot:
    """alive_since.lua's whole reply ``{now, version, 'gid,deadline,...'}`` -> a snapshot."""
    now_ms, version, flat = int(reply[0]), decode(reply[1]), decode(reply[2])
    values = flat.split(",") if flat else []
    if len(values) % 2:
        raise ValueError(f"alive_since reply has {len(values)} values, not gid/deadline pairs")
    deadlines = {int(values[i]): float(values[i + 1]) for i in range(0, len(values), 2)}
    return AliveSnapshot(version, deadlines, now_ms)


class AliveCache:
    """The latest snapshots of each model's alive gids, for one reader (a router process)."""

    def __init__(self) -> None:
        self._latest: dict[str, AliveSnapshot] = {}
        self._kept: dict[str, OrderedDict[str, AliveSnapshot]] = {}

    def call(self, keys: ModelKeys) -> ScriptCall[Any]:
        """The alive_since.lua call that checks this reader's latest copy of the model's gids."""
        held = self._latest.get(keys.model)
        if held is None:
            return lua.alive_since(keys, "", 0)  # refresh-before 0: the whole set, always
        return lua.alive_since(keys, held.version, held.refresh_before_ms)

    def alive(self, model: str, reply: list[Any]) -> set[int] | None:
        """The gids alive at the reply's server time; None when the reply confirms a copy this
        cache no longer keeps (read again with :meth:`call`)."""
        now_ms = int(reply[0])
        if len(reply) >= 3:
            snapshot = parse_snapshot(reply)
            self._keep(model, snapshot)
            return snapshot.alive_at(now_ms)
        kept = self._kept.get(model)
        held = None if kept is None else kept.get(decode(reply[1]))
        return None if held is None else held.alive_at(now_ms)

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
