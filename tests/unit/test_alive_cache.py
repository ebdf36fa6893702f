"""A reader's copy of the alive gids (kvindex.alive_cache), on replies built by hand."""

from __future__ import annotations

from kvindex import calls as lua
from kvindex.alive_cache import (
    CONFIRM_MARGIN_MS,
    KEPT_SNAPSHOTS,
    MAX_AGE_MS,
    AliveCache,
    AliveSnapshot,
    parse_snapshot,
)
from kvindex.keys import KeySchema

KEYS = KeySchema().for_model("m")


def whole(now: int, version: str, deadlines: dict[int, int]) -> list[object]:
    return [now, version.encode(), ",".join(f"{g},{d}" for g, d in deadlines.items()).encode()]


def test_a_whole_reply_is_parsed_and_gids_lapse_by_their_deadlines():
    snapshot = parse_snapshot(whole(1000, "7", {1: 1500, 2: 3000}))
    assert snapshot == AliveSnapshot("7", {1: 1500.0, 2: 3000.0}, 1000)
    assert snapshot.alive_at(1499) == {1, 2} and snapshot.alive_at(1500) == {2}
    assert parse_snapshot([5, b"", b""]).deadlines == {}


def test_a_copy_is_refreshed_before_its_first_deadline_and_at_least_every_max_age():
    assert AliveSnapshot("v", {1: 1300.0, 2: 9000.0}, 1000).refresh_before_ms == 1300
    assert AliveSnapshot("v", {1: 90_000.0}, 1000).refresh_before_ms == 1000 + MAX_AGE_MS
    assert AliveSnapshot("v", {}, 1000).refresh_before_ms == 1000 + MAX_AGE_MS
    # Lapsed gids (kept from an earlier read of the same version) cannot end the copy.
    assert AliveSnapshot("v", {1: 500.0, 2: 1400.0}, 1000).refresh_before_ms == 1400


def test_the_first_call_asks_for_the_whole_set_and_later_ones_carry_the_copy():
    cache = AliveCache()
    assert cache.call(KEYS).args[:2] == ["", 0]
    cache.alive("m", whole(1000, "7", {1: 1500}))  # untagged: the server's clock is not known
    assert cache.call(KEYS).args[:2] == ["7", 1500]
    assert list(cache.call(KEYS).keys) == [KEYS.alive, KEYS.alive_version]


def test_a_confirmation_is_read_against_the_copy_it_confirms():
    cache = AliveCache()
    assert cache.alive("m", whole(1000, "7", {1: 1500, 2: 3000})) == {1, 2}
    assert cache.alive("m", [1400, b"7"]) == {1, 2}
    assert cache.alive("m", [1600, b"7"]) == {2}
    assert cache.alive("m", [1600, b"unknown"]) is None  # read the whole set again
    assert cache.alive("other", [1600, b"7"]) is None


def test_a_later_read_of_the_same_version_keeps_what_an_earlier_one_knew():
    cache = AliveCache()
    cache.alive("m", whole(1000, "7", {1: 1500, 2: 3000}))
    cache.alive("m", whole(2000, "7", {2: 6000}))  # gid 1 lapsed at 1500
    # A confirmation sent with the first copy and answered at 1400 still finds gid 1 alive.
    assert cache.alive("m", [1400, b"7"]) == {1, 2}
    assert cache.call(KEYS).args[:2] == ["7", 3000]  # min(6000, read + MAX_AGE_MS)


def test_a_whole_reply_that_arrives_late_does_not_replace_a_newer_copy():
    cache = AliveCache()
    cache.alive("m", whole(2000, "8", {1: 9000}))
    cache.alive("m", whole(1000, "7", {1: 1500, 2: 3000}))
    assert cache.call(KEYS).args[0] == "8"
    assert cache.alive("m", [1200, b"7"]) == {1, 2}


def test_only_the_latest_copies_are_kept():
    cache = AliveCache()
    for v in range(KEPT_SNAPSHOTS + 1):
        cache.alive("m", whole(1000 + v, str(v), {v: 5000}))
    assert cache.alive("m", [1500, b"0"]) is None
    assert cache.alive("m", [1500, str(KEPT_SNAPSHOTS).encode()]) == {KEPT_SNAPSHOTS}


class Clock:
    def __init__(self, s: float) -> None:
        self.s = s

    def __call__(self) -> float:
        return self.s


def tagged(now: int, version: str, tag: str, deadlines: dict[int, int] | None) -> list[object]:
    listed = None if deadlines is None else whole(now, version, deadlines)[2]
    return [now, version.encode(), tag.encode(), listed]


def test_a_tagged_read_lets_later_matches_confirm_the_copy_by_its_version_alone():
    clock = Clock(10.0)
    cache = AliveCache(clock)
    call = cache.call(KEYS)
    assert call.spec is lua.ALIVE_SINCE and float(call.args[2]) == 10.0
    # The server ran it at 50,000 ms when this reader's clock said 10.0 s or later.
    assert cache.alive("m", tagged(50_000, "7", call.args[2], {1: 50_400, 2: 90_000})) == {1, 2}
    clock.s = 10.2  # the server's clock is at most 50,200
    assert cache.call(KEYS).spec is lua.ALIVE_VERSION
    assert cache.alive("m", b"7") == {1, 2}
    assert cache.alive("m", b"8") is None  # another version: read the whole set again
    # Within the margin of gid 1's deadline, the script confirms (it knows the server's time).
    clock.s = 10.4 - CONFIRM_MARGIN_MS / 1000
    assert cache.call(KEYS).spec is lua.ALIVE_SINCE
    # A version's reply read once the bound reached the deadline is not trusted.
    clock.s = 10.4
    assert cache.alive("m", b"7") is None


def test_the_bound_follows_the_latest_tagged_reply_and_a_tagged_confirmation_is_read():
    clock = Clock(10.0)
    cache = AliveCache(clock)
    cache.alive("m", tagged(50_000, "7", "10.0", {1: 90_000}))
    # The server's clock was set back 5 s: the next script's reply says so.
    assert cache.alive("m", tagged(45_100, "7", "10.1", None)) == {1}
    clock.s = 10.5
    assert cache.call(KEYS).spec is lua.ALIVE_VERSION  # bound 45,500, copy good until 51,000
    # An older call's reply, answered late, does not move the bound back.
    cache.alive("m", tagged(60_000, "7", "9.0", None))
    assert cache.call(KEYS).spec is lua.ALIVE_VERSION
