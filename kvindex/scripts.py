"""Loads the Lua scripts in lua/ and runs them by EVALSHA, reloading on NOSCRIPT.

A Redis restart (or SCRIPT FLUSH, or a failover to a replica) empties the script cache; every
call goes through :meth:`Scripts.call`, which sends the script itself (EVAL, which also caches it
on that server) when the server does not know it. On Redis Cluster each call goes to the shard of
its keys (a replica for read-only scripts when the client reads from replicas), and several calls
run concurrently, one per shard. On a single server, batches (:meth:`Scripts.call_many`) go over
one pipelined connection beside the client's pool (:mod:`kvindex.pipelined`): waiting callers
may be cancelled without losing it.
:meth:`Scripts.run` is the same call with the scripts' own ``kvroute:`` errors raised as
:mod:`kvindex.errors` exceptions (what the index's reads and writes use).

Retries: one policy for every path (one call, a batch on one server, a batch on a cluster). Each
reply is classed by :func:`outcome`:

* ``ANSWER``: a reply, or the script's own error: final, never sent again.
* ``NO_SCRIPT``: the server does not have the script (a restart, SCRIPT FLUSH, a failover, a new
  shard): the script is given to it once (SCRIPT LOAD of every script on a single server; EVAL
  with the source where a call lands, on a cluster or for one call) and the call sent again.
* ``NOT_DELIVERED``: no answer reached us (a lost connection, a moved slot, TRYAGAIN): the call is
  sent once more (every script is idempotent, so one the server did run is harmless): on a fresh
  connection on a single server; on a cluster as one redis-py pipeline (one connection per node,
  the slot map refreshed), and what fails again one call at a time, at most REDO_AT_ONCE at once.

Beneath this, redis-py's client retries a command whose connection fails (RedisSettings.client:
three tries, exponential backoff). A call that still has no answer raises (one call) or is left
as the exception in its place (a batch): the callers (the router's degraded decision, the agent's
mirror and re-assert) own what happens next.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from redis.exceptions import (
    AskError,
    MovedError,
    NoScriptError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from kvindex.calls import SPECS, KeyOrArg, ScriptCall
from kvindex.cluster import RedisClient, is_cluster
from kvindex.cluster_links import ClusterLinks
from kvindex.pipelined import PipelinedConnection
from kvindex.replies import raise_script_error

SCRIPT_NAMES = tuple(SPECS)
REDO_AT_ONCE = 8  # calls sent again one by one on a cluster, at most this many at a time
R = TypeVar("R")
__all__ = ["READ_ONLY_SCRIPTS", "SCRIPT_NAMES", "KeyOrArg", "ScriptCall", "Scripts", "parsed"]

# Read-only scripts: flagged `#!lua flags=no-writes` and sent as EVALSHA_RO, so that a user whose
# ACL only lets it read the index can run them, and a replica can serve them.
READ_ONLY_SCRIPTS = frozenset(name for name, spec in SPECS.items() if spec.read_only)


def lua_dir() -> Path:
    """Where the scripts are: packaged next to this module in a wheel, else the repo's lua/."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "lua", here.parent / "lua"):
        if (candidate / "page_match.lua").is_file():
            return candidate
    raise FileNotFoundError(f"kvroute's Lua scripts were not found next to {here}")


@dataclass(frozen=True)
class Script:
    name: str
    source: bytes
    sha: str


def load_scripts(directory: Path | None = None) -> dict[str, Script]:
    directory = directory or lua_dir()
    scripts = {}
    for name in SCRIPT_NAMES:
        source = (directory / f"{name}.lua").read_bytes()
        scripts[name] = Script(name, source, hashlib.sha1(source).hexdigest())
    return scripts


class Scripts:
    """Runs kvroute's Lua scripts on one Redis client."""

    def __init__(self, client: RedisClient, scripts: dict[str, Script] | None = None) -> None:
        self._client = client
        self._scripts = scripts or load_scripts()
        self._cluster = is_cluster(client)
        # Each script's command and SHA, as RESP: the start of every call of it.
        self._heads = {name: _bulk(_command(name)) + _bulk(s.sha) for name, s in self._scripts.items()}
        # A single server's batches go over one pipelined connection beside the client's pool.
        self._pipelined = None if self._cluster else PipelinedConnection.for_client(client)
        self._links = ClusterLinks(client) if self._cluster else None  # type: ignore[arg-type]
        self.reloads = 0
        self._loading: asyncio.Future[None] | None = None  # the load of every script under way

    @property
    def cancel_safe(self) -> bool:
        """Whether a :meth:`call_many` may be cancelled while it waits for its replies at no cost:
        they are read and dropped. Else (a cluster, a connection kind the pipelined connection does
        not take over) cancelling it closes the connection it was on."""
        return self._pipelined is not None

    async def aclose(self) -> None:
        """Close the pipelined connection (the client's own pool is closed by the client)."""
        if self._pipelined is not None:
            await self._pipelined.aclose()
        if self._links is not None:
            await self._links.aclose()

    async def load_all(self) -> None:
        """Load every script, in one round trip (a single server; a cluster's shards learn them
        on first use). Callers at once share one load, and it goes on when they stop waiting: a
        burst of decisions that meets an empty script cache (a restart, a failover) sends the
        scripts once. (Loaded one by one in each caller, a busy router's decisions, cancelled at
        their budget, restarted the loads faster than any finished: the last scripts were never
        loaded and the router stayed degraded.)"""
        if self._cluster:
            return
        loading = self._loading
        if loading is None or loading.done() or loading.get_loop() is not asyncio.get_running_loop():
            loading = self._loading = asyncio.ensure_future(self._load_every_script())
            loading.add_done_callback(_retrieved)
        await asyncio.shield(loading)

    async def _load_every_script(self) -> None:
        scripts = list(self._scripts.values())
        if self._pipelined is not None:
            commands = [chunk for s in scripts for chunk in self._pipelined.pack_command("SCRIPT", "LOAD", s.source)]
            shas = await self._pipelined.execute(commands, len(scripts))
        else:
            pipe = self._client.pipeline(transaction=False)
            for script in scripts:
                pipe.script_load(script.source)
            shas = list(await pipe.execute(raise_on_error=False))
        for script, sha in zip(scripts, shas, strict=True):
            if isinstance(sha, Exception):
                raise sha
            if (sha.decode() if isinstance(sha, bytes) else sha) != script.sha:  # pragma: no cover - a broken Redis
                raise RuntimeError(f"Redis hashed {script.name}.lua as {sha!r}, expected {script.sha}")

    async def call_many(self, calls: Sequence[ScriptCall[Any]]) -> list[Any]:
        """Several script calls in one round trip (a pipeline, not a transaction). Errors come
        back in the list as exception objects; a missing script is loaded and the batch rerun.
        On a cluster the calls run concurrently, each on the shard of its keys."""
        if self._cluster:
            return await self._cluster_round_trip(calls)
        resent = reloaded = False
        while True:
            try:
                results = await self._round_trip(calls)
            except RedisConnectionError:
                # NOT_DELIVERED (a pooled connection the server closed: it restarted): once more,
                # on a fresh connection.
                if resent:
                    raise
                resent = True
                continue
            if not reloaded and any(outcome(r) is Outcome.NO_SCRIPT for r in results):
                self.reloads += 1
                reloaded = True
                await self.load_all()
                continue
            return results

    async def _round_trip(self, calls: Sequence[ScriptCall[Any]]) -> list[Any]:
        """The commands written together in one write and their replies read in order: on the
        pipelined connection (:mod:`kvindex.pipelined`), else on a connection of the pool."""
        if self._pipelined is None:
            return await self._pooled_round_trip(calls)
        results = await self._pipelined.execute(self._pack(self._pipelined, calls), len(calls))
        for result in results:
            if isinstance(result, RedisConnectionError):  # LOADING and the like: raised, as redis-py does
                raise result
        return results

    async def _pooled_round_trip(self, calls: Sequence[ScriptCall[Any]]) -> list[Any]:
        """What redis-py's pipeline does, without its per-command bookkeeping (a third of a
        routing decision's CPU). A connection interrupted mid-reply (a timeout, a cancelled
        request) is closed, never reused with replies pending."""
        pool = self._client.connection_pool  # type: ignore[union-attr]
        connection = await pool.get_connection()
        try:
            try:
                await connection.send_packed_command(self._pack(connection, calls), check_health=False)
                results: list[Any] = []
                for _ in calls:
                    try:
                        results.append(await connection.read_response())
                    except ResponseError as exc:
                        results.append(exc)
            except AttributeError as exc:
                # redis-py can lose a connection's stream under a concurrent close and then fail
                # with AttributeError ('NoneType' ... 'writelines', redis-py #4287): a dropped
                # connection, for the callers' retry and failure handling.
                raise RedisConnectionError(f"the Redis connection was closed under us ({exc})") from exc
        except BaseException:
            await connection.disconnect()
            raise
        finally:
            await pool.release(connection)
        return results

    def _pack(self, connection: Any, calls: Sequence[ScriptCall[Any]]) -> list[bytes]:
        """The calls as RESP, each in one pass (redis-py's encoder takes ~10 us a call): str
        (UTF-8, redis-py's default), bytes and int arguments; a call
        with any other argument goes through redis-py's encoder (``connection.pack_command``)."""
        out: list[bytes] = []
        for call in calls:
            name, keys, args, command = call.name, call.keys, call.args, call.spec.command
            try:
                key_part = _bulks(keys)
                arg_part = _bulks(args)
            except TypeError:  # a float, a bool (refused there)...
                out += connection.pack_command(*self._words(call))
                continue
            if command is not None:
                out.append(b"*%d\r\n%s%s%s" % (1 + len(keys) + len(args), _bulk(command), key_part, arg_part))
                continue
            head = self._heads[name]
            out.append(b"*%d\r\n%s%s%s%s" % (3 + len(keys) + len(args), head, _bulk(len(keys)), key_part, arg_part))
        return out

    def _words(self, call: ScriptCall[Any]) -> tuple[KeyOrArg, ...]:
        """The call as a command's words: EVALSHA(_RO) with its script's SHA, or a plain command."""
        if call.spec.command is not None:
            return (call.spec.command, *call.keys, *call.args)
        name = call.name
        return (_command(name), self._scripts[name].sha, len(call.keys), *call.keys, *call.args)

    async def call(self, call: ScriptCall[Any]) -> Any:
        """One call, its reply as Redis sent it (see :meth:`run` for the parsed one)."""
        if call.spec.command is not None:
            return await self._client.execute_command(*self._words(call))
        name, keys, args = call.name, call.keys, call.args
        script = self._scripts[name]
        try:
            return await self._client.execute_command(*self._words(call))
        except NoScriptError:
            self.reloads += 1
            # EVAL caches the script on whichever server the call lands on (a cluster's shard or
            # replica), so the next EVALSHA there finds it.
            return await self._client.execute_command(_evaluation(name), script.source, len(keys), *keys, *args)

    async def _cluster_round_trip(self, calls: Sequence[ScriptCall[Any]]) -> list[Any]:
        """The calls in one round trip per shard that has calls (a decision's alive, load and
        expected reads share the model's shard), the shards at once: on each node's pipelined
        connection (:mod:`kvindex.cluster_links`), else as one redis-py cluster pipeline. The
        calls that met a moved slot or a lost connection on the links go again as one redis-py
        pipeline (a failover loses every call to a node at once: one connection per node for
        them, not one per call). A call the shard does not know the script for is sent again
        with it; one that failed still is sent again on its own, with the cluster client's
        retries (it refreshes the slot map and follows MOVED and ASK)."""
        results = await self._links.round_trip(calls, self._pack) if self._links is not None else None
        if results is None:
            results = await self._pipeline_round_trip(calls)
        else:
            failed = [i for i, r in enumerate(results) if outcome(r) is Outcome.NOT_DELIVERED]
            if failed:
                again = await self._pipeline_round_trip([calls[i] for i in failed])
                for i, result in zip(failed, again, strict=True):
                    results[i] = result
        unknown = [i for i, r in enumerate(results) if outcome(r) is Outcome.NO_SCRIPT]
        if unknown:
            await self._evaluate_on_their_shards(calls, unknown, results)
        redo = [i for i, r in enumerate(results) if outcome(r) is not Outcome.ANSWER]
        if redo:
            # A few at a time: each takes a connection of its node's pool, and after a failover a
            # batch of hundreds (a writer's re-assert) at once emptied it (MaxConnectionsError).
            slots = asyncio.Semaphore(REDO_AT_ONCE)

            async def one(call: ScriptCall[Any]) -> Any:
                async with slots:
                    return await self._call_or_error(call)

            again = await asyncio.gather(*(one(calls[i]) for i in redo))
            for i, result in zip(redo, again, strict=True):
                results[i] = result
        return results

    async def _pipeline_round_trip(self, calls: Sequence[ScriptCall[Any]]) -> list[Any]:
        """The calls as one redis-py cluster pipeline: one connection per shard that has calls."""
        pipe = self._client.pipeline(transaction=False)
        for call in calls:
            pipe.execute_command(*self._words(call))
        try:
            return list(await pipe.execute(raise_on_error=False))
        except RedisError:
            return [RedisError()] * len(calls)  # a shard that went away mid-pipeline (a failover)

    async def _evaluate_on_their_shards(
        self, calls: Sequence[ScriptCall[Any]], unknown: list[int], results: list[Any]
    ) -> None:
        """The calls a shard had no script for, sent again with their source (EVAL caches it
        there) as one more pipeline: one connection per shard, as the first try took. Sent one by
        one instead, a fresh cluster's first burst of decisions (no shard has the scripts yet)
        took a connection per call and emptied the node's pool under a slow shard."""
        self.reloads += 1
        pipe = self._client.pipeline(transaction=False)
        for i in unknown:
            name, keys, args = calls[i].name, calls[i].keys, calls[i].args
            pipe.execute_command(_evaluation(name), self._scripts[name].source, len(keys), *keys, *args)
        try:
            again: list[Any] = list(await pipe.execute(raise_on_error=False))
        except RedisError:
            return  # left as NOSCRIPT: sent again one by one, with the cluster client's retries
        for i, result in zip(unknown, again, strict=True):
            results[i] = result

    async def _call_or_error(self, call: ScriptCall[Any]) -> Any:
        try:
            return await self.call(call)
        except ResponseError as exc:
            return exc

    async def run(self, call: ScriptCall[R]) -> R:
        """:meth:`call`, its reply parsed by the call's declaration (:mod:`kvindex.calls`); a
        script's own error (``kvroute: ...``) becomes a :class:`~kvindex.errors.KVIndexError`."""
        try:
            return call.parse(await self.call(call))
        except ResponseError as exc:
            raise_script_error(exc)


def parsed(call: ScriptCall[R], reply: Any) -> R:
    """One reply of :meth:`Scripts.call_many`, parsed by its call's declaration; an error in its
    place raised (a script's own as a :class:`~kvindex.errors.KVIndexError`)."""
    if isinstance(reply, ResponseError):
        raise_script_error(reply)
    if isinstance(reply, Exception):
        raise reply
    return call.parse(reply)


def _retrieved(loading: asyncio.Future[None]) -> None:
    """A load whose callers all stopped waiting: its failure is no one's to raise any more."""
    if not loading.cancelled():
        loading.exception()


class Outcome(enum.Enum):
    """What a reply in a batch means for the retry policy (the module's docstring)."""

    ANSWER = "answer"
    NO_SCRIPT = "no_script"
    NOT_DELIVERED = "not_delivered"


def outcome(reply: object) -> Outcome:
    """A reply or an error in its place, classed: an error the script itself returned is an answer;
    a missing script and an error of reaching the script (a connection, a moved slot) are not."""
    if not isinstance(reply, Exception):
        return Outcome.ANSWER
    if isinstance(reply, NoScriptError):
        return Outcome.NO_SCRIPT
    if isinstance(reply, ResponseError) and not isinstance(reply, MovedError | AskError | TryAgainError):
        return Outcome.ANSWER
    return Outcome.NOT_DELIVERED


def _bulk(value: KeyOrArg) -> bytes:
    """One RESP bulk string, encoded as redis-py's default encoder does; TypeError for what it
    would encode otherwise (or refuse)."""
    if isinstance(value, str):
        value = value.encode()
    elif isinstance(value, int) and not isinstance(value, bool):
        value = b"%d" % value
    elif not isinstance(value, bytes):
        raise TypeError(f"not packed here: {type(value).__name__}")
    return b"$%d\r\n%s\r\n" % (len(value), value)


def _bulks(values: Sequence[KeyOrArg]) -> bytes:
    """RESP bulk strings of ``values``: all bytes in one pass (what the index's hot calls send),
    else one by one (:func:`_bulk`)."""
    try:
        return b"".join([b"$%d\r\n%b\r\n" % (len(v), v) for v in values])  # type: ignore[arg-type,str-format]
    except TypeError:  # a str, an int: len() or %b refuses it
        return b"".join(map(_bulk, values))


def _evaluation(name: str) -> str:
    """The command that sends ``name`` with its source (and caches it on that server)."""
    return "EVAL_RO" if name in READ_ONLY_SCRIPTS else "EVAL"


def _command(name: str) -> str:
    return "EVALSHA_RO" if name in READ_ONLY_SCRIPTS else "EVALSHA"
