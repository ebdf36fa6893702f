"""Least-privilege Redis users for kvroute: the ACL rules of each role, built from the key schema.

``kvroute redis acl`` prints them as ``ACL SETUSER`` commands (docs/security.md explains each rule).

* router: reads the index (workers, their records, liveness, block keys) and writes only the
  routing state the replicas share (its lease and in-flight load, the expected prefixes). The
  index keys are read-only to it (``%R~``), and Redis 7 checks every command a Lua script runs
  against the caller's user, so not even apply.lua or register.lua can write them for it.
* agent: writes ownership (block keys, block logs), worker records, liveness and the model's
  bookkeeping, through the scripts; no access to the routers' state.
* admin: everything (``kvroute index gc``, flushing, configuration).

No role but admin has FLUSHALL, FLUSHDB, CONFIG, DEBUG, SHUTDOWN, KEYS, MONITOR, SCRIPT FLUSH,
ACL or any other command outside its list: each role starts from ``-@all`` and names what it
sends. Key patterns are Redis globs over the schema of :mod:`kvindex.keys` with ``*`` for the
model, or the models named (``--model``), which keeps a worker id holding ``}`` from ever
matching another kind of key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvindex.keys import DEFAULT_PREFIX, BucketKeys, KeySchema, ModelKeys

ROLES = ("router", "agent", "admin")
PLACEHOLDER = "\ue000"  # stands for the model name while a key is turned into a glob
BUCKET_PLACEHOLDER = "\ue001"  # stands for the bucket number

# What every client sends on connecting (HELLO, AUTH, CLIENT SETNAME, SELECT; not CLIENT SETINFO,
# unknown to Redis 7.0, which refuses the whole rule; redis-py ignores its refusal) and the
# cluster client's discovery (COMMAND, CLUSTER SLOTS/SHARDS/NODES, READONLY for replica reads).
CONNECTION_COMMANDS = (
    "ping", "hello", "auth", "echo", "select", "client|setname", "client|getname", "client|id",
    "command", "cluster|slots", "cluster|shards", "cluster|nodes", "cluster|info", "cluster|myid",
    "readonly", "readwrite", "info", "time", "multi", "exec", "discard",
    "evalsha", "evalsha_ro", "eval", "eval_ro", "script|load",
)  # fmt: skip
READ_COMMANDS = (
    "exists", "get", "hget", "hmget", "hgetall", "hkeys", "hlen", "hexists", "zrange", "zrangebyscore",
    "zrevrangebyscore", "zscore", "zcard", "smembers", "sinter", "sismember", "scard", "strlen", "getrange", "pttl",
)  # fmt: skip
# The writes each role's scripts and clients send (lua/*.lua, kvindex, kvindex/shared_load.py).
ROUTER_WRITES = ("hset", "hdel", "hincrby", "zadd", "zrem", "del", "unlink", "pexpire")
AGENT_WRITES = (
    "hset", "hdel", "hincrby", "zadd", "zrem", "sadd", "srem", "append", "set", "del", "unlink", "pexpire",
)  # fmt: skip


def _glob_escape(text: str) -> str:
    """``text`` matched literally by a Redis glob."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


@dataclass(frozen=True)
class KeyPatterns:
    """The key globs of one role: read-only ones and read-write ones."""

    read: tuple[str, ...]
    write: tuple[str, ...]


def _model_keys(prefix: str, models: Sequence[str]) -> list[tuple[ModelKeys, str]]:
    """(keys of a model whose name is a placeholder, how to write that name as a glob)."""
    schema = KeySchema(prefix)
    if not models:
        return [(schema.for_model(PLACEHOLDER), "*")]
    return [(schema.for_model(PLACEHOLDER), _glob_escape(model)) for model in models]


def _globs(keys: ModelKeys, name: str, kinds: Sequence[str]) -> list[str]:
    """Globs for the key kinds (ModelKeys attribute names, or BucketKeys ones after 'bucket.';
    those ending in _prefix take '*'). A bucket's number is any text ('*')."""
    bucket = BucketKeys(keys.bucket_base(BUCKET_PLACEHOLDER))
    out = []
    for kind in kinds:
        owner, attribute = (bucket, kind[len("bucket.") :]) if kind.startswith("bucket.") else (keys, kind)
        key = _glob_escape(getattr(owner, attribute)) + ("*" if kind.endswith("_prefix") else "")
        out.append(key.replace(PLACEHOLDER, name).replace(BUCKET_PLACEHOLDER, "*"))
    return out


# Key kinds by who writes them (ModelKeys attributes). tests/index/test_acl.py checks that every
# kind in kvindex/keys.py is listed here, so a new key cannot be forgotten.
ROUTER_STATE_KINDS = ("replicas", "inflight_prefix", "expected", "expected_deadlines", "learned", "learned_at")
ROUTER_READ_KINDS = (
    "meta", "workers", "gids", "alive", "alive_version", "worker_prefix", "bucket.segment_prefix",
    "bucket.block_prefix",  # the layout before pages (read by routers of that version)
)  # fmt: skip
AGENT_KINDS = (
    "meta", "workers", "gids", "alive", "alive_version", "retired", "worker_prefix", "gid_buckets_prefix",
    "bucket.segment_prefix", "bucket.page_log_prefix", "bucket.state_prefix",
    "bucket.block_prefix", "bucket.log_prefix",  # the layout before pages: gc collects it
)  # fmt: skip


def key_patterns(role: str, prefix: str = DEFAULT_PREFIX, models: Sequence[str] = ()) -> KeyPatterns:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    models_key = _glob_escape(KeySchema(prefix).models)
    read: list[str] = []
    write: list[str] = []
    for keys, name in _model_keys(prefix, models):
        if role == "router":
            read += _globs(keys, name, ROUTER_READ_KINDS)
            write += _globs(keys, name, ROUTER_STATE_KINDS)
        elif role == "agent":
            write += _globs(keys, name, AGENT_KINDS)
    if role == "router":
        read.append(models_key)
    elif role == "agent":
        write.append(models_key)
    else:
        write = ["*"]
    return KeyPatterns(tuple(read), tuple(write))


def password_hash(password: str) -> str:
    """The SHA-256 form ACL SETUSER takes (``#<hex>``): the printed commands never hold the password."""
    if not password:
        raise ValueError("the password may not be empty")
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def acl_rules(role: str, password: str, prefix: str = DEFAULT_PREFIX, models: Sequence[str] = ()) -> list[str]:
    """The ACL SETUSER rules of a role, after the user name. ``reset`` first: applying them again
    replaces the user's rules, never adds to older ones."""
    patterns = key_patterns(role, prefix, models)
    rules = ["reset", "on", password_hash(password), "resetchannels"]
    if role == "admin":
        return [*rules, "allkeys", "allchannels", "+@all"]
    writes = ROUTER_WRITES if role == "router" else AGENT_WRITES
    rules.append("-@all")
    rules += [f"+{c}" for c in (*CONNECTION_COMMANDS, *READ_COMMANDS, *writes)]
    rules += [f"%R~{p}" for p in patterns.read]
    rules += [f"~{p}" for p in patterns.write]
    return rules


def _quote(word: str) -> str:
    """One redis-cli argument: bare when it is safe, else in double quotes with escapes."""
    if word and not any(c.isspace() or c in "\"'\\" or not c.isprintable() for c in word):
        return word
    escaped = "".join(
        "\\" + c if c in '"\\' else (c if c.isprintable() and c not in "\n\r\t" else f"\\x{ord(c):02x}") for c in word
    )
    return f'"{escaped}"'


def acl_commands(
    role: str, user: str, password: str, prefix: str = DEFAULT_PREFIX, models: Sequence[str] = (), aclfile: bool = False
) -> list[str]:
    """The commands to run, one a line, ready for ``redis-cli`` (stdin or arguments); with
    ``aclfile``, the same rules as lines of a Redis ACL file (``user NAME RULES``)."""
    if not user or any(c.isspace() or not c.isprintable() for c in user):
        raise ValueError(f"user name must be printable without spaces, got {user!r}")
    rules = acl_rules(role, password, prefix, models)
    head = "user " if aclfile else "ACL SETUSER "
    return [head + " ".join(_quote(w) for w in [user, *rules])]
