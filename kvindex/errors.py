"""Errors of the index, shared by both backends."""


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
