"""The Redis key schema: every key kvroute reads or writes is built here and nowhere else.

Two kinds of keys, so that one model's index spreads over every master of a Redis Cluster while
each script call still touches one slot:

* *Control keys* of a model (its meta, workers, gids, liveness, records, router replicas' load)
  share the hash tag ``{<model>}``: one slot, one shard.
* *Bucket keys* (segment keys, and each gid's page log and state in that bucket) carry the tag
  ``{<model>#<bucket>}``, where the bucket (0..BUCKETS-1) is drawn from the hash of the
  segment's first block (kvindex.pages: a chain's pages in segments that double along it). So
  one prompt's segments lie in many buckets, hence on every master, even when all of a model's
  prompts start alike; a match is one script call per segment key (one in all on a single
  Redis). The block keys and block logs of the layout before pages keep their names, for gc.

Every key a script touches is declared in its KEYS. On a single Redis the same layout is used;
the tags then mean nothing. See docs/index-schema.md for the layout and redis-cli recipes.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "kvr"
MAX_NAME_LENGTH = 512
# Buckets per model. Enough that 16 masters get ~64 each (an even spread of roots), few enough
# that a gid's per-bucket state stays small (a worker touches at most this many buckets).
BUCKETS = 1024
_MASK64 = (1 << 64) - 1
_FIBONACCI = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads structured hashes (1, 2, 3...) too


def bucket_of(root_hash: int) -> int:
    """The bucket of a chain whose first block hashes to ``root_hash`` (multiplicative hashing:
    the top 10 bits of root * 2^64/phi)."""
    return ((root_hash * _FIBONACCI) & _MASK64) >> 54


def _check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} must be a non-empty string")
    if len(value) > MAX_NAME_LENGTH:
        raise ValueError(f"{kind} is longer than {MAX_NAME_LENGTH} characters")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ValueError(f"{kind} {value!r} contains control characters")
    return value


def block_hex(block_hash: int) -> str:
    """The 16-digit lower-case hex form of an unsigned 64-bit block hash, as used in keys."""
    if not 0 <= block_hash < 1 << 64:
        raise ValueError(f"block hash {block_hash} is not an unsigned 64-bit integer")
    return f"{block_hash:016x}"


def validate_prefix(prefix: str) -> str:
    _check_name("key prefix", prefix)
    if "{" in prefix or "}" in prefix:
        raise ValueError(f"key prefix {prefix!r} may not contain braces (they would move the hash tag)")
    return prefix


@dataclass(frozen=True)
class KeySchema:
    """Key names for one deployment (one prefix)."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        validate_prefix(self.prefix)

    @property
    def models(self) -> str:
        """SET of model names that have registered workers (the only key without a model tag)."""
        return f"{self.prefix}:models"

    def for_model(self, model: str) -> ModelKeys:
        return ModelKeys(self.prefix, _check_name("model name", model))


@dataclass(frozen=True)
class ModelKeys:
    """Every key of one model; all share the hash tag ``{model}``."""

    prefix: str
    model: str

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{{self.model}}}:"

    @property
    def meta(self) -> str:
        """HASH: block_size, block_keys (distinct block keys)."""
        return self.base + "meta"

    @property
    def workers(self) -> str:
        """HASH: worker id -> current gid."""
        return self.base + "workers"

    @property
    def gids(self) -> str:
        """HASH: gid -> worker id (until the gid is garbage-collected)."""
        return self.base + "gids"

    @property
    def alive(self) -> str:
        """ZSET: gid -> heartbeat deadline in ms (Redis server clock)."""
        return self.base + "alive"

    @property
    def alive_version(self) -> str:
        """STRING: the version of ``alive``'s membership, new whenever a gid joins or leaves it
        or a deadline is lowered (alive_since.lua); an integer, never handed out twice."""
        return self.base + "alive_version"

    @property
    def retired(self) -> str:
        """ZSET: gid -> retirement time in ms; gc works through it oldest first."""
        return self.base + "retired"

    @property
    def worker_prefix(self) -> str:
        return self.base + "w:"

    def worker(self, worker_id: str) -> str:
        """HASH: a worker's record (url, block_size, dp_rank, gid, epoch, heartbeat, blocks...)."""
        return self.worker_prefix + _check_name("worker id", worker_id)

    @property
    def gid_buckets_prefix(self) -> str:
        return self.base + "gb:"

    def gid_buckets(self, gid: int | str) -> str:
        """SET: the buckets a gid has entries in (gc visits them when the gid is retired)."""
        return f"{self.gid_buckets_prefix}{gid}"

    def bucket_base(self, bucket: str) -> str:
        """The start of a bucket's keys, for any text standing for the bucket number (ACL globs)."""
        return f"{self.prefix}:{{{self.model}#{bucket}}}:"

    def bucket(self, bucket: int) -> BucketKeys:
        if not 0 <= bucket < BUCKETS:
            raise ValueError(f"bucket {bucket} is not within 0..{BUCKETS - 1}")
        return BucketKeys(self.bucket_base(f"{bucket:03x}"), bucket)

    def bucket_of_segment(self, first_block: int) -> BucketKeys:
        """The bucket keys of the segment whose first block hashes to ``first_block`` (the next
        layout, kvindex.pages: a chain's segments in their own buckets)."""
        return self.bucket(bucket_of(first_block))

    def segment(self, first_block: int) -> str:
        """HASH: a segment's pages' holdings (kvindex.pages), in the bucket of its first block."""
        return self.bucket_of_segment(first_block).segment(first_block)

    def bucket_of_chain(self, chain_root: int) -> BucketKeys:
        """The bucket keys of the chain whose first block hashes to ``chain_root`` (the layout
        before pages, whose block keys gc still collects)."""
        return self.bucket(bucket_of(chain_root))

    # --- shared routing state (router replicas) ---------------------------------------------

    @property
    def replicas(self) -> str:
        """ZSET: router replica id -> lease deadline in ms; a replica's load counts until then."""
        return self.base + "replicas"

    @property
    def inflight_prefix(self) -> str:
        return self.base + "inflight:"

    def inflight(self, replica_id: str) -> str:
        """HASH: one replica's in-flight load per worker, fields ``<kind>:<worker id>`` with kind
        r (requests), t (prompt tokens) or u (predicted uncached prompt tokens)."""
        return self.inflight_prefix + _check_name("replica id", replica_id)

    @property
    def expected(self) -> str:
        """HASH: block hash (hex) -> worker id it was just routed to (not yet announced)."""
        return self.base + "expected"

    @property
    def expected_deadlines(self) -> str:
        """ZSET: block hash (hex) -> when its ``expected`` entry lapses (ms)."""
        return self.base + "expected_at"

    @property
    def learned(self) -> str:
        """HASH: the cost model the router replicas learn together (router/routing/model_sync.py):
        decayed sums, fields ``<kind>:<name>[:<worker id>]``; ``@<replica>``: its last batch."""
        return self.base + "learned"

    @property
    def learned_at(self) -> str:
        """ZSET: router replica id -> when it last added to ``learned`` (ms)."""
        return self.base + "learned_at"


@dataclass(frozen=True)
class BucketKeys:
    """The keys of one bucket of a model: all share the hash tag ``{model#bucket}``."""

    base: str
    number: int = -1

    @property
    def block_prefix(self) -> str:
        return self.base + "b:"

    def block(self, block_hash: int) -> str:
        """SET: the gids that hold the block (integers: Redis keeps small sets as intsets)."""
        return self.block_prefix + block_hex(block_hash)

    @property
    def segment_prefix(self) -> str:
        return self.base + "s:"

    def segment(self, first_block: int) -> str:
        """HASH: the holdings in the pages of the segment whose first block hashes to
        ``first_block``; for a page P: ``h:<P>`` (gids with a holding), ``e:<leaf>`` (gids whose
        holding ends there), ``t:<leaf>`` (the branch to the leaf), ``g:<P>:<gid>`` (the gid's
        leaves). See kvindex.pages and docs/index-schema.md, "Pages, segments and buckets"."""
        return self.segment_prefix + block_hex(first_block)

    @property
    def page_log_prefix(self) -> str:
        return self.base + "pl:"

    def page_log(self, gid: int | str) -> str:
        """STRING: 32 hex digits per page the gid came to hold in this bucket (its segment's first
        block, then its own), oldest first: what gc visits."""
        return f"{self.page_log_prefix}{gid}"

    @property
    def log_prefix(self) -> str:
        return self.base + "log:"

    def log(self, gid: int | str) -> str:
        """STRING: 8-byte big-endian hashes of the blocks the gid indexed in this bucket, oldest first."""
        return f"{self.log_prefix}{gid}"

    @property
    def state_prefix(self) -> str:
        return self.base + "g:"

    def state(self, gid: int | str) -> str:
        """HASH: the gid's state in this bucket: ``op`` (last write id applied), ``n`` (entries),
        ``c`` (gc cursor); ``dead`` once gc collected it (then it expires)."""
        return f"{self.state_prefix}{gid}"
