"""One typed declaration per Lua script in lua/, and the calls built from them.

Each :class:`ScriptSpec` says what its script's header says (docs/index-schema.md, "Lua scripts"):
the KEYS and ARGV by position, whether it is read-only (``#!lua flags=no-writes``, sent as
EVALSHA_RO), and how its reply becomes a Python value. The builder functions below take the key
schema and typed values and return a :class:`ScriptCall`; every caller (the index, its writers
and collector, the routers' shared state) builds its calls here, and
:meth:`kvindex.scripts.Scripts.run` parses a reply with its call's parser. A test checks each
declaration against its script's header and flag (``tests/unit/test_calls.py``).

Pure: no I/O here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvindex.keys import BucketKeys, ModelKeys, block_hex
from kvindex.pages import Page, PageChange, match_args, page_change_args, segments
from kvindex.replies import decode
from kvindex.types import adapter_names

R = TypeVar("R")
KeyOrArg = str | bytes | int


def _raw(reply: Any) -> Any:
    return reply


def _status(reply: Any) -> str:
    return decode(reply)


def _integer(reply: Any) -> int:
    return int(reply)


def _status_and_ints(reply: Any) -> tuple[str, ...]:
    """``{status, n, ...}``: the status decoded, the rest as they came (callers read ints)."""
    return (decode(reply[0]), *reply[1:])


@dataclass(frozen=True)
class ScriptSpec(Generic[R]):
    """A script's declaration. ``keys`` and ``args`` name its KEYS and ARGV by position; a
    last name ending in ``...`` takes any number more (none included), one ending in ``?`` is
    optional. With ``command``, a plain Redis command sent in a batch beside script calls
    instead of a script (its keys route it on a cluster); it has no file in lua/."""

    name: str
    keys: tuple[str, ...]
    args: tuple[str, ...]
    read_only: bool
    parse: Callable[[Any], R]
    command: str | None = None

    def __post_init__(self) -> None:
        # How many KEYS and ARGV a call may have, worked out once: a router builds calls per decision.
        object.__setattr__(self, "_key_counts", _counts(self.keys))
        object.__setattr__(self, "_arg_counts", _counts(self.args))

    def call(self, keys: Sequence[KeyOrArg], args: Sequence[KeyOrArg] = ()) -> ScriptCall[R]:
        low, high = self._key_counts  # type: ignore[attr-defined]
        if not low <= len(keys) <= high:
            _refuse(self.name, "KEYS", self.keys, len(keys))
        low, high = self._arg_counts  # type: ignore[attr-defined]
        if not low <= len(args) <= high:
            _refuse(self.name, "ARGV", self.args, len(args))
        return ScriptCall(self, keys, args)


def _counts(names: tuple[str, ...]) -> tuple[int, float]:
    """The least and most values a list of ``names`` takes."""
    fixed = sum(1 for n in names if not n.endswith(("...", "?")))
    optional = sum(1 for n in names if n.endswith("?"))
    variadic = bool(names) and names[-1].endswith("...")
    return fixed, float("inf") if variadic else fixed + optional


def _refuse(script: str, what: str, names: tuple[str, ...], given: int) -> None:
    raise ValueError(f"{script}.lua takes {what} {', '.join(names) or 'none'}; {given} given")


@dataclass(frozen=True, slots=True)
class ScriptCall(Generic[R]):
    """One call of a script: its declaration, keys and arguments."""

    spec: ScriptSpec[R]
    keys: Sequence[KeyOrArg]
    args: Sequence[KeyOrArg]

    @property
    def name(self) -> str:
        return self.spec.name

    def parse(self, reply: Any) -> R:
        return self.spec.parse(reply)


def _spec(name: str, keys: str, args: str, parse: Callable[[Any], R], read_only: bool = False) -> ScriptSpec[R]:
    return ScriptSpec(name, tuple(keys.split()), tuple(args.split()), read_only, parse)


# --- the index: registrations and liveness (the model's control slot) ----------------------
REGISTER = _spec(
    "register",
    "meta workers gids alive retired record alive_version",
    "worker_id url model block_size dp_rank ttl_ms gid adapters? tier? tier_of? role? max_model_len? engine_kind?",
    _status_and_ints,
)
ADAPTERS = _spec("adapters", "record", "gid adapters kv_groups?", _status)
HEARTBEAT = _spec("heartbeat", "record alive alive_version", "gid ttl_ms", _status)
LOAD = _spec("load", "record", "gid running waiting kv_usage capacity_blocks?", _status)
CLEAR = _spec(
    "clear", "meta workers gids alive retired record alive_version", "worker_id gid mode new_gid?", _status_and_ints
)
STAGE = _spec("stage", "gids alive retired record", "worker_id gid staged stage_ttl_ms", _status)
SWAP = _spec(
    "swap", "workers alive retired record alive_version", "worker_id gid staged ttl_ms blocks", _status_and_ints
)
CLAIM = _spec("claim", "record gid_buckets", "gid bucket...", _status)
TALLY = _spec("tally", "record meta", "gid blocks key_delta", _status)
ALIVE = _spec("alive", "zset", "mode? limit? grace_ms?", _raw, read_only=True)
ALIVE_SINCE = _spec("alive_since", "alive alive_version", "version refresh_before_ms tag?", _raw, read_only=True)
# A reader's copy of the alive gids confirmed by their version alone (kvindex.alive_cache).
ALIVE_VERSION = ScriptSpec("alive_version", ("alive_version",), (), True, _raw, command="GET")
# Who holds a one-block chain (a hybrid model's window-group block, kvindex/groups.py): its page's
# e: field, the gids whose holding ends there.
GROUP_HOLDERS = ScriptSpec("group_holders", ("segment",), ("field",), True, _raw, command="HGET")
GC_RETIRE = _spec("gc_retire", "workers gids alive retired record...", "grace_ms gid...", _integer)
GC_FINISH = _spec("gc_finish", "gids retired gid_buckets", "gid", _integer)

# --- the index: a bucket's slot ------------------------------------------------------------
RELOG = _spec("relog", "state log", "gid previous_op op log entry_bytes?", _status_and_ints)
GC_BUCKET = _spec("gc_bucket", "state log block...", "gid cursor dead_ttl_ms block_prefix", _status_and_ints)
GC_PAGES = _spec("gc_pages", "state log segment...", "gid cursor dead_ttl_ms segment_prefix", _status_and_ints)
PAGE_APPLY = _spec("page_apply", "bucket_key...", "gid buckets bucket_change...", _raw)
PAGE_MATCH = _spec("page_match", "segment...", "chained blocks key_pages...", _raw, read_only=True)

# --- the routers' shared state (the model's control slot) ----------------------------------
LEASE = _spec("lease", "replicas inflight", "replica_id ttl_ms expire_ms field_value...", _raw)
INFLIGHT_ADD = _spec("inflight_add", "inflight", "expire_ms field_delta...", _raw)
INFLIGHT = _spec("inflight", "replicas inflight...", "replica_id...", _raw, read_only=True)
EXPECT = _spec("expect", "expected expected_at", "worker_id ttl_ms block_hex...", _integer)
SETTLE = _spec("settle", "expected expected_at", "worker_id ttl_ms block_hex...", _integer)
EXPECTED = _spec("expected", "expected expected_at", "block_hex...", _raw, read_only=True)
LEARN = _spec("learn", "learned learned_at", "replica_id batch_id forget_after_ms expire_ms n field...", _raw)

SPECS: dict[str, ScriptSpec[Any]] = {
    s.name: s
    for s in (
        REGISTER, ADAPTERS, HEARTBEAT, CLAIM, TALLY, LOAD, CLEAR, RELOG, STAGE, SWAP, GC_RETIRE,
        GC_BUCKET, GC_PAGES, GC_FINISH, PAGE_APPLY, PAGE_MATCH, ALIVE, ALIVE_SINCE, LEASE, INFLIGHT_ADD,
        INFLIGHT, EXPECT, SETTLE, EXPECTED, LEARN,
    )
}  # fmt: skip


# --- builders: the calls, from the key schema and typed values -----------------------------


def register(
    keys: ModelKeys,
    worker_id: str,
    url: str,
    block_size: int,
    dp_rank: int,
    ttl_ms: int,
    gid: int,
    adapters: Sequence[str] = (),
    tier: str = "",
    tier_of: str = "",
    role: str = "both",
    max_model_len: int = 0,
    engine_kind: str = "",
) -> ScriptCall[tuple[str, ...]]:
    """``tier`` and ``tier_of``: a tier holder's tier and worker ('' for a worker's own GPU blocks);
    ``role`` its part in a prefill/decode split (kvindex.roles); ``max_model_len`` its engine's
    context length (0: unknown); ``engine_kind`` how its agent reads the engine ('': not said)."""
    record = keys.worker(worker_id)
    identity: list[str | int] = [worker_id, url, keys.model, block_size, dp_rank, ttl_ms, gid]
    return REGISTER.call(
        [keys.meta, keys.workers, keys.gids, keys.alive, keys.retired, record, keys.alive_version],
        [*identity, adapter_lines(adapters), tier, tier_of, role, max_model_len, engine_kind],
    )


def adapters(
    keys: ModelKeys, worker_id: str, gid: int, names: Sequence[str], kv_groups: str | None = None
) -> ScriptCall[str]:
    """adapters.lua; ``kv_groups`` (kvindex.groups.format_groups) recorded too when given."""
    rest = [] if kv_groups is None else [kv_groups]
    return ADAPTERS.call([keys.worker(worker_id)], [gid, adapter_lines(names), *rest])


def adapter_lines(names: Sequence[str]) -> str:
    """The adapters' names as a record keeps them: one per line, sorted, each once."""
    return "\n".join(adapter_names(names))


def heartbeat(keys: ModelKeys, worker_id: str, gid: int, ttl_ms: int) -> ScriptCall[str]:
    return HEARTBEAT.call([keys.worker(worker_id), keys.alive, keys.alive_version], [gid, ttl_ms])


def load(
    keys: ModelKeys, worker_id: str, gid: int, running: int, waiting: int, kv_usage: float, capacity: int | None
) -> ScriptCall[str]:
    args: list[KeyOrArg] = [gid, running, waiting, repr(kv_usage)]
    if capacity:
        args.append(capacity)
    return LOAD.call([keys.worker(worker_id)], args)


def clear(
    keys: ModelKeys, worker_id: str, gid: int | str, mode: str, new_gid: int | None = None
) -> ScriptCall[tuple[str, ...]]:
    args: list[KeyOrArg] = [worker_id, gid, mode]
    if new_gid is not None:
        args.append(new_gid)
    control = [keys.meta, keys.workers, keys.gids, keys.alive, keys.retired, keys.worker(worker_id), keys.alive_version]
    return CLEAR.call(control, args)


def stage(keys: ModelKeys, worker_id: str, gid: int, staged: int, stage_ttl_ms: int) -> ScriptCall[str]:
    control = [keys.gids, keys.alive, keys.retired, keys.worker(worker_id)]
    return STAGE.call(control, [worker_id, gid, staged, stage_ttl_ms])


def swap(
    keys: ModelKeys, worker_id: str, gid: int, staged: int, ttl_ms: int, blocks: int
) -> ScriptCall[tuple[str, ...]]:
    control = [keys.workers, keys.alive, keys.retired, keys.worker(worker_id), keys.alive_version]
    return SWAP.call(control, [worker_id, gid, staged, ttl_ms, blocks])


def claim(keys: ModelKeys, worker_id: str, gid: int, buckets: Sequence[int]) -> ScriptCall[str]:
    return CLAIM.call([keys.worker(worker_id), keys.gid_buckets(gid)], [gid, *buckets])


def tally(keys: ModelKeys, worker_id: str, gid: int, blocks: int, key_delta: int) -> ScriptCall[str]:
    return TALLY.call([keys.worker(worker_id), keys.meta], [gid, blocks, key_delta])


def alive(zset: str, mode: str | None = None, *limits: int) -> ScriptCall[Any]:
    """alive.lua over ``zset`` (the model's ``alive``, ``retired`` or ``replicas``)."""
    return ALIVE.call([zset], [] if mode is None else [mode, *limits])


def alive_since(keys: ModelKeys, version: str, refresh_before_ms: int, tag: str | None = None) -> ScriptCall[Any]:
    """alive_since.lua: the alive gids unless the reader's copy of ``version`` still holds."""
    args: list[KeyOrArg] = [version, refresh_before_ms] if tag is None else [version, refresh_before_ms, tag]
    return ALIVE_SINCE.call([keys.alive, keys.alive_version], args)


def alive_version(keys: ModelKeys) -> ScriptCall[Any]:
    """GET of the model's ``alive_version``: what confirms a reader's copy between its reads."""
    return ALIVE_VERSION.call([keys.alive_version])


def gc_retire(keys: ModelKeys, grace_ms: int, gids: Sequence[str], records: Sequence[str]) -> ScriptCall[int]:
    control = [keys.workers, keys.gids, keys.alive, keys.retired, *records]
    return GC_RETIRE.call(control, [grace_ms, *gids])


def gc_finish(keys: ModelKeys, gid: str) -> ScriptCall[int]:
    return GC_FINISH.call([keys.gids, keys.retired, keys.gid_buckets(gid)], [gid])


def relog(
    bucket: BucketKeys, gid: int, previous_op: int, op: int, log: bytes, page_log: bool = False
) -> ScriptCall[tuple[str, ...]]:
    """relog.lua: a block log (8 bytes an entry) or, ``page_log``, a page log (32)."""
    if page_log:
        return RELOG.call([bucket.state(gid), bucket.page_log(gid)], [gid, previous_op, op, log, 32])
    return RELOG.call([bucket.state(gid), bucket.log(gid)], [gid, previous_op, op, log])


def gc_bucket(
    bucket: BucketKeys, gid: str, cursor: int, dead_ttl_ms: int, block_keys: Sequence[str]
) -> ScriptCall[tuple[str, ...]]:
    keys = [bucket.state(gid), bucket.log(gid), *block_keys]
    return GC_BUCKET.call(keys, [gid, cursor, dead_ttl_ms, bucket.block_prefix])


def gc_pages(
    bucket: BucketKeys, gid: str, cursor: int, dead_ttl_ms: int, segments: Sequence[str]
) -> ScriptCall[tuple[str, ...]]:
    keys = [bucket.state(gid), bucket.page_log(gid), *segments]
    return GC_PAGES.call(keys, [gid, cursor, dead_ttl_ms, bucket.segment_prefix])


@dataclass(frozen=True)
class BucketPages:
    """One bucket's part of a page_apply.lua call: op ids, the change in the gid's indexed
    blocks there, and its page changes."""

    bucket: BucketKeys
    previous_op: int
    op: int
    block_delta: int
    changes: Sequence[PageChange]


def page_apply(gid: int, parts: Sequence[BucketPages]) -> ScriptCall[Any]:
    """page_apply.lua: one gid's page changes in one or more buckets (one on a cluster)."""
    keys: list[KeyOrArg] = []
    args: list[KeyOrArg] = [gid, len(parts)]
    for part in parts:
        places: dict[int, int] = {}
        for change in part.changes:
            places.setdefault(change.segment, len(places) + 1)
        keys += [part.bucket.state(gid), part.bucket.page_log(gid), *(part.bucket.segment(s) for s in places)]
        args += [part.previous_op, part.op, part.block_delta, len(places), len(part.changes)]
        for change in part.changes:
            args += page_change_args(change, places[change.segment])
    return PAGE_APPLY.call(keys, args)


def page_match(keys: ModelKeys, pages: Sequence[Page], chain: Sequence[int], chained: bool) -> ScriptCall[Any]:
    """page_match.lua over ``pages`` of ``chain`` (chained: they are its first pages, in order)."""
    return PAGE_MATCH.call([keys.segment(s) for s, _ in segments(pages)], match_args(pages, chain, chained))


def lease(keys: ModelKeys, replica_id: str, ttl_ms: int, expire_ms: int, pairs: Sequence[KeyOrArg]) -> ScriptCall[Any]:
    return LEASE.call([keys.replicas, keys.inflight(replica_id)], [replica_id, ttl_ms, expire_ms, *pairs])


def inflight_add(keys: ModelKeys, replica_id: str, expire_ms: int, pairs: Sequence[KeyOrArg]) -> ScriptCall[Any]:
    return INFLIGHT_ADD.call([keys.inflight(replica_id)], [expire_ms, *pairs])


def inflight(keys: ModelKeys, replicas: Sequence[str]) -> ScriptCall[Any]:
    return INFLIGHT.call([keys.replicas, *(keys.inflight(r) for r in replicas)], list(replicas))


def group_holders(keys: ModelKeys, name: int) -> ScriptCall[Any]:
    return GROUP_HOLDERS.call([keys.segment(name)], ["e:" + block_hex(name)])


def expect(keys: ModelKeys, worker_id: str, ttl_ms: int, hexes: Sequence[str], settle: bool = False) -> ScriptCall[int]:
    spec = SETTLE if settle else EXPECT
    return spec.call([keys.expected, keys.expected_deadlines], [worker_id, ttl_ms, *hexes])


def expected(keys: ModelKeys, hexes: Sequence[str]) -> ScriptCall[Any]:
    return EXPECTED.call([keys.expected, keys.expected_deadlines], list(hexes))


def learn(
    keys: ModelKeys, replica_id: str, batch_id: str, forget_ms: int, expire_ms: int, rest: Sequence[KeyOrArg]
) -> ScriptCall[Any]:
    """learn.lua: ``rest`` is ARGV[5..]: the count of fields to delete, them, then quadruples."""
    return LEARN.call([keys.learned, keys.learned_at], [replica_id, batch_id, forget_ms, expire_ms, *rest])
