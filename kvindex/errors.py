"""Errors of the index, shared by both backends."""

from redis.exceptions import RedisError


class KVIndexError(Exception):
    """Base class: a request the index rejects, with a message that says why."""


class NotRegisteredError(KVIndexError):
    """A write for a worker this client has not registered (only its registrant may write it)."""


class StaleGenerationError(KVIndexError):
    """The worker was re-registered or garbage-collected elsewhere; this writer must re-register."""


class BlockSizeMismatchError(KVIndexError):
    """A worker announced a block size different from the one its model's alive workers use."""


class ScriptArgumentError(KVIndexError):
    """A Lua script rejected its arguments (a bug in the caller, never a state change)."""


# What a call to Redis raises when Redis or the link to it fails, not the caller: redis-py's
# errors, a socket's, a timeout, the index's refusals, and RuntimeError: uvloop raises it for a
# write on a transport that redis-py's cluster client closed under it during a failover (a
# router's load writer died of it in tests/e2e/faults/test_cluster_failover.py, and its process
# then exited 1 at shutdown). The loops that talk to Redis catch these and carry on.
REDIS_FAILURES = (RedisError, OSError, TimeoutError, KVIndexError, RuntimeError)
