"""kvindex.pipelined on real servers: many callers' requests on one connection, replies in order,
errors as redis-py's exceptions, an abandoned request's reply dropped without losing the
connection, a lost server failing what waits and a new connection on the next call, and the
client's own settings (ACL user and password, database, TLS) honoured."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import AuthenticationError, DataError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvindex.keys import KeySchema
from kvindex.pipelined import PipelinedConnection, WireWatch, wire_watch
from kvindex.redis_index import RedisIndex
from kvindex.scripts import SCRIPT_NAMES, Scripts, load_scripts
from kvindex.settings import RedisSettings
from kvindex.types import StoredRun, WorkerInfo
from kvroute.devstack.embedded_redis import RedisServer
from tests.support import raw_call, wait_until
from tests.support.tls import Certificates, TlsRedis, make_certificates


def pipelined_for(client: Redis) -> PipelinedConnection:
    connection = PipelinedConnection.for_client(client)
    assert connection is not None
    return connection


async def run(connection: PipelinedConnection, *commands: tuple[object, ...]) -> list[object]:
    packed = [chunk for command in commands for chunk in connection.pack_command(*command)]
    return await connection.execute(packed, len(commands))


async def connections_named(observer: Redis, name: str) -> int:
    return sum(1 for c in await observer.client_list() if c["name"] == name)


@pytest.fixture
async def observer(redis_server) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


async def test_concurrent_callers_share_one_connection_and_each_gets_its_own_replies(
    redis_server, observer, unique_name
):
    client = RedisSettings(url=redis_server.url).client(client_name=unique_name)
    connection = pipelined_for(client)
    try:
        replies = await asyncio.gather(*(run(connection, ("ECHO", f"a{i}"), ("ECHO", f"b{i}")) for i in range(200)))
        assert replies == [[f"a{i}".encode(), f"b{i}".encode()] for i in range(200)]
        assert await connections_named(observer, unique_name) == 1
    finally:
        await connection.aclose()
        await client.aclose()


async def test_error_replies_come_back_as_redis_py_exceptions_in_place(redis_server):
    client = Redis.from_url(redis_server.url)
    connection = pipelined_for(client)
    try:
        assert await run(connection) == []  # an empty batch is answered at once
        missing, echoed, wrong = await run(
            connection, ("EVALSHA", "0" * 40, 0), ("ECHO", "still in order"), ("NOSUCHCOMMAND",)
        )
        assert isinstance(missing, NoScriptError)
        assert echoed == b"still in order"
        assert isinstance(wrong, ResponseError) and not isinstance(wrong, NoScriptError)
    finally:
        await connection.aclose()
        await client.aclose()


def comparable(reply: object) -> object:
    return (type(reply), str(reply)) if isinstance(reply, Exception) else reply


@pytest.mark.parametrize("protocol", [2, 3])
async def test_script_batches_read_the_same_as_on_a_pooled_connection(redis_server, unique_name, protocol):
    client = Redis.from_url(redis_server.url, protocol=protocol)
    index = RedisIndex(client, KeySchema(unique_name))
    scripts = index.scripts
    try:
        worker = await index.register(WorkerInfo("w0", "tiny", "http://127.0.0.1:9", 4))
        await worker.store([StoredRun(None, (11, 12, 13))])
        _, match = index.match_calls("tiny", [11, 12, 99])
        calls = [match, raw_call("expected", [f"{unique_name}:e"]), raw_call("alive", ["a", "b"], ["nonsense"])]
        assert scripts.cancel_safe
        pipelined = [comparable(r) for r in await scripts._round_trip(calls)]
        assert pipelined == [comparable(r) for r in await scripts._pooled_round_trip(calls)]
        assert pipelined[0] and isinstance(pipelined[2], tuple), pipelined  # a match found, an error reply
    finally:
        await scripts.aclose()
        await client.aclose()


async def test_a_flushed_script_cache_is_reloaded_through_call_many(redis_server, observer, unique_name):
    client = Redis.from_url(redis_server.url)
    scripts = Scripts(client)
    try:
        await scripts.load_all()
        await observer.script_flush()
        (alive,) = await scripts.call_many([raw_call("alive", [f"{unique_name}:alive"])])
        assert not isinstance(alive, Exception) and scripts.reloads == 1
    finally:
        await scripts.aclose()
        await client.aclose()


def scripts_over(client: Redis, path: str) -> Scripts:
    """Scripts on ``client``: its batches on the pipelined connection, or on the client's pool
    (the path where the pipelined connection cannot take a connection kind over)."""
    scripts = Scripts(client)
    assert scripts.cancel_safe
    if path == "pool":
        scripts._pipelined = None
    return scripts


async def script_loads(observer: Redis) -> int:
    stats = await observer.info("commandstats")
    return int(stats.get("cmdstat_script|load", {}).get("calls", 0))


@pytest.mark.parametrize("path", ["pipelined", "pool"])
async def test_a_burst_that_meets_a_flushed_script_cache_loads_the_scripts_once(
    redis_server, observer, unique_name, path
):
    client = Redis.from_url(redis_server.url)
    scripts = scripts_over(client, path)
    try:
        await scripts.load_all()
        await observer.script_flush()
        await observer.config_resetstat()
        replies = await asyncio.gather(
            *(scripts.call_many([raw_call("alive", [f"{unique_name}:alive"])]) for _ in range(50))
        )
        assert not any(isinstance(r, Exception) for (r,) in replies), replies
        assert await script_loads(observer) == len(SCRIPT_NAMES)  # one load for the 50 callers
    finally:
        if path == "pipelined":
            await scripts.aclose()
        await client.aclose()


@pytest.mark.parametrize("path", ["pipelined", "pool"])
async def test_a_reload_that_every_caller_stops_waiting_for_still_loads_every_script(redis_server, observer, path):
    """A busy router's decisions are cancelled at their budget, maybe while the scripts are
    being loaded again: the load must finish all the same, or the next decisions meet NOSCRIPT,
    start it over, give up again, and the router never leaves degraded mode."""
    client = Redis.from_url(redis_server.url)
    scripts = scripts_over(client, path)
    try:
        await observer.script_flush()
        caller = asyncio.create_task(scripts.load_all())
        await asyncio.sleep(0)  # it starts the load...
        caller.cancel()  # ...and gives up at once
        with pytest.raises(asyncio.CancelledError):
            await caller
        shas = [script.sha for script in load_scripts().values()]

        async def every_script_loaded() -> bool:
            return all(await observer.script_exists(*shas))

        await wait_until(every_script_loaded, 10)
    finally:
        if path == "pipelined":
            await scripts.aclose()
        await client.aclose()


async def test_a_caller_that_stops_waiting_leaves_the_connection_in_use(redis_server, observer, unique_name):
    client = RedisSettings(url=redis_server.url).client(client_name=unique_name)
    connection = pipelined_for(client)
    watch = WireWatch()
    settled = asyncio.Event()
    watch.on_settled = settled.set
    try:
        (first_id,) = await run(connection, ("CLIENT", "ID"))
        token = wire_watch.set(watch)
        with pytest.raises(TimeoutError):  # the server holds the reply 0.3 s
            await asyncio.wait_for(run(connection, ("BLPOP", f"{unique_name}:never", 0.3)), 0.02)
        wire_watch.reset(token)
        assert watch.pending == 1 and not settled.is_set()
        # The next request is answered after the abandoned one's reply, which is read and dropped.
        assert await run(connection, ("ECHO", "next"), ("CLIENT", "ID")) == [b"next", first_id]
        assert settled.is_set() and watch.pending == 0
        assert await connections_named(observer, unique_name) == 1
    finally:
        await connection.aclose()
        await client.aclose()


def test_a_new_event_loop_gets_a_new_connection(redis_server):
    connection = pipelined_for(Redis.from_url(redis_server.url))

    async def echo(text: str, close: bool = False) -> list[object]:
        try:
            return await asyncio.wait_for(run(connection, ("ECHO", text)), 5)
        finally:
            if close:
                await connection.aclose()

    assert asyncio.run(echo("one")) == [b"one"]
    assert asyncio.run(echo("two", close=True)) == [b"two"]  # not on the first loop's socket, never read


async def test_no_reply_within_the_socket_timeout_closes_the_connection_and_the_next_call_reconnects(redis_server):
    client = Redis.from_url(redis_server.url, socket_timeout=0.1)
    connection = pipelined_for(client)
    try:
        (first_id,) = await run(connection, ("CLIENT", "ID"))
        with pytest.raises(RedisTimeoutError):
            await run(connection, ("BLPOP", "kvroute-test:never", 1))
        (second_id,) = await run(connection, ("CLIENT", "ID"))
        assert second_id != first_id
    finally:
        await connection.aclose()
        await client.aclose()


@pytest.mark.faults
async def test_a_killed_server_fails_the_waiting_requests_and_a_restarted_one_is_reconnected_to():
    server = RedisServer().start()
    client = RedisSettings(url=server.url).client()  # as kvroute's processes make it: reconnects
    scripts = Scripts(client)
    connection = pipelined_for(client)
    try:
        assert await run(connection, ("PING",)) == [b"PONG"]
        waiting = asyncio.ensure_future(run(connection, ("BLPOP", "kvroute-test:never", 5)))
        await asyncio.sleep(0)  # written before the kill
        await scripts.load_all()
        await scripts.call_many([raw_call("alive", ["kvroute-test:alive"])])  # its own connection is up
        server.stop(kill=True)
        with pytest.raises(RedisConnectionError):
            await waiting
        server = RedisServer(port=server.port).start()
        assert await run(connection, ("PING",)) == [b"PONG"]
        # call_many's connection was lost too: reconnected (and the scripts loaded) in one call.
        (alive,) = await scripts.call_many([raw_call("alive", ["kvroute-test:alive"])])
        assert not isinstance(alive, Exception) and scripts.reloads == 1
    finally:
        await connection.aclose()
        await scripts.aclose()
        await client.aclose()
        server.stop()


async def test_an_acl_user_with_its_password_and_database(redis_server, observer, unique_name):
    await observer.acl_setuser(unique_name, enabled=True, passwords=["+pipe-pw"], keys=["*"], commands=["+@all"])
    url = f"redis://{unique_name}@127.0.0.1:{redis_server.port}/3"
    client = RedisSettings(url=url, password="pipe-pw").client()
    connection = pipelined_for(client)
    wrong_client = RedisSettings(url=url, password="not-it").client()
    wrong = pipelined_for(wrong_client)
    try:
        assert await run(connection, ("ACL", "WHOAMI"), ("SET", f"{unique_name}:k", "v")) == [
            unique_name.encode(),
            b"OK",
        ]
        in_db3 = Redis.from_url(f"redis://127.0.0.1:{redis_server.port}/3")
        assert await in_db3.get(f"{unique_name}:k") == b"v"
        await in_db3.delete(f"{unique_name}:k")
        await in_db3.aclose()
        with pytest.raises(AuthenticationError):
            await run(wrong, ("PING",))
    finally:
        await connection.aclose()
        await wrong.aclose()
        await client.aclose()
        await wrong_client.aclose()
        await observer.acl_deluser(unique_name)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TlsRedis, Certificates]]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make the test's CA and certificates")
    certs = make_certificates(tmp_path_factory.mktemp("tls"))
    server = TlsRedis(certs, tmp_path_factory.mktemp("tls-redis"))
    yield server, certs
    server.stop()


async def test_tls_with_the_clients_ca_and_certificate(tls_redis):
    server, certs = tls_redis
    settings = RedisSettings(
        url=server.url, tls_ca=str(certs.ca), tls_cert=str(certs.client_cert), tls_key=str(certs.client_key)
    )
    client = settings.client()
    scripts = Scripts(client)
    try:
        assert scripts.cancel_safe
        (alive,) = await scripts.call_many([raw_call("alive", ["kvroute-test:alive"])])
        assert not isinstance(alive, Exception)
        assert await run(pipelined_for(client), ("ECHO", "over tls")) == [b"over tls"]
    finally:
        await scripts.aclose()
        await client.aclose()


def test_arguments_packed_outside_the_fast_path_are_redis_pys_bytes():
    scripts = Scripts(None)  # type: ignore[arg-type]
    packer = Connection()
    calls = [raw_call("alive", ["k"], [1.5, memoryview(b"mv")]), raw_call("alive", ["k", "é"], [True])]
    head = ("EVALSHA_RO", scripts._scripts["alive"].sha)
    assert b"".join(scripts._pack(packer, calls[:1])) == b"".join(packer.pack_command(*head, 1, "k", 1.5, b"mv"))
    with pytest.raises(DataError):  # redis-py refuses a bool: so does the fast path, by falling back
        scripts._pack(packer, calls[1:])
