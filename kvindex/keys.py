"""The Redis key schema: every key kvroute reads or writes is built here and nowhere else.

All keys of one model share the hash tag ``{<model>}``, so each Lua script (which only ever
touches one model) runs unchanged on Redis Cluster: its keys sit in one slot. Scripts receive
the key prefixes below and derive per-block, per-gid and per-worker keys from them; those keys
carry the same tag and therefore live in the slot of the keys the call declares.
See docs/index-schema.md for the layout and redis-cli recipes.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "kvr"
MAX_NAME_LENGTH = 512


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
    def retired(self) -> str:
        """ZSET: gid -> retirement time in ms; gc works through it oldest first."""
        return self.base + "retired"

    @property
    def gc_cursors(self) -> str:
        """HASH: gid -> bytes of its block log still to collect."""
        return self.base + "gc"

    @property
    def worker_prefix(self) -> str:
        return self.base + "w:"

    def worker(self, worker_id: str) -> str:
        """HASH: a worker's record (url, block_size, dp_rank, gid, epoch, heartbeat, blocks...)."""
        return self.worker_prefix + _check_name("worker id", worker_id)

    @property
    def log_prefix(self) -> str:
        return self.base + "log:"

    def log(self, gid: int | str) -> str:
        """STRING: 8-byte big-endian hashes of the blocks a gid indexed, oldest first."""
        return f"{self.log_prefix}{gid}"

    @property
    def block_prefix(self) -> str:
        return self.base + "b:"

    def block(self, block_hash: int) -> str:
        """SET: the gids that hold the block."""
        return self.block_prefix + block_hex(block_hash)

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
