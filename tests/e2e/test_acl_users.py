"""Agents and a router running as the least-privilege Redis users that ``kvroute redis acl``
makes, with ``--redis-password-file``, on a single Redis and on a cluster (where ACLs are per
node, so the printed ACL SETUSER is applied on every node). Traffic routes by the cache; the
router's user cannot write a worker record, neither by a plain command nor through a script."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import redis
from redis.exceptions import ResponseError

from kvindex.keys import KeySchema
from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvindex.types import WorkerInfo
from kvroute.devstack.embedded_cluster import LocalCluster
from kvroute.devstack.embedded_redis import RedisServer, default_server_binary
from tests.support import ROOT, SimFleet, wait_until
from tests.support.cluster import (
    PROMPT_BLOCKS,
    index_credits,
    make_acl_user,
    prime,
    routed_to,
    start_router_process,
    wait_held,
)

ROLES = ("agent", "router")


@dataclass
class Deployment:
    """Where the index lives: ``url_as(user)`` for a client of that user, ``ports`` every node."""

    kind: str
    address: str  # HOST:PORT[,HOST:PORT...]
    ports: list[int]
    admin: Callable[[int], redis.Redis]  # port -> a client of that node's default user

    def url_as(self, user: str) -> str:
        scheme = "redis+cluster" if self.kind == "cluster" else "redis"
        return f"{scheme}://{user}@{self.address}" + ("" if self.kind == "cluster" else "/0")


@pytest.fixture(scope="module")
def single_server() -> Iterator[tuple[RedisServer, redis.Redis]]:
    """A private server and a client of its default user."""
    server = RedisServer(binary=default_server_binary()).start()
    admin = redis.Redis(port=server.port)
    yield server, admin
    admin.close()
    server.stop()


@pytest.fixture(params=["single", "cluster"])
def deployment(request: pytest.FixtureRequest) -> Deployment:
    if request.param == "cluster":
        cluster: LocalCluster = request.getfixturevalue("redis_cluster")
        address = ",".join(f"{host}:{port}" for host, port in cluster.startup_nodes)
        return Deployment("cluster", address, sorted(cluster.nodes), cluster.client)
    server, admin = request.getfixturevalue("single_server")
    return Deployment("single", f"127.0.0.1:{server.port}", [server.port], lambda _: admin)


@pytest.fixture
def users(deployment: Deployment, unique_name: str, tmp_path: Path) -> dict[str, tuple[str, Path]]:
    """An agent and a router user (names of this test's own) made by ``kvroute redis acl`` and
    applied as the default user on every node: role -> (user name, its password file)."""
    made = {}
    for role in ROLES:
        user, password_file = f"{unique_name}-{role}", tmp_path / f"{role}.pw"
        password_file.write_text(f"{role}-secret-{unique_name}\n")
        make_acl_user(role, user, password_file, [deployment.admin(port) for port in deployment.ports])
        made[role] = (user, password_file)
    return made


@pytest.fixture
async def fleet(deployment: Deployment, users, unique_name: str) -> AsyncIterator[SimFleet]:
    user, password_file = users["agent"]
    started = SimFleet(
        deployment.url_as(user), model=unique_name, agent_args=["--redis-password-file", str(password_file)]
    )
    try:
        yield await started.start()
    finally:
        await started.stop()


def client_as(deployment: Deployment, user: str, password_file: Path):
    settings = RedisSettings(url=deployment.url_as(user), password=password_file.read_text().strip())
    return settings.client()


async def test_agents_and_router_as_least_privilege_users_route_by_the_cache(deployment, users, fleet):
    model = fleet.model
    router_user, router_password = users["router"]
    process, url = await start_router_process(
        deployment.url_as(router_user), "--redis-password-file", str(router_password)
    )
    agent_client = client_as(deployment, *users["agent"])
    index = RedisIndex(agent_client)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

            async def every_worker_routable() -> bool:
                explained = await index_credits(session, url, model, [1] * 16)
                return len(explained) == fleet.count  # not degraded, every worker alive

            await wait_until(every_worker_routable, 30)
            for k in range(6):
                prompt = [(k * 131 + i * 7) % 1900 + 10 for i in range(PROMPT_BLOCKS * 16)]
                worker = fleet.worker_id(k % fleet.count)
                await prime(session, fleet.engine_of(worker).url, model, prompt)
                await wait_held(index, model, prompt, worker)
                assert (await index_credits(session, url, model, prompt)).get(worker) == PROMPT_BLOCKS
                assert await routed_to(session, url, model, [*prompt, 42]) == worker
            assert {users["agent"][0], router_user} <= logged_in_users(deployment)

            async def model_shared() -> bool:  # learn.lua runs as the router user
                async with session.get(url + "/debug/model", params={"model": model}) as response:
                    shared = (await response.json())["shared"]
                assert shared["failures"] == 0, shared
                return shared["syncs"] > 0

            await wait_until(model_shared, 10)
    finally:
        process.terminate()
        assert process.wait(15) == 0
        await agent_client.aclose()
    for agent in fleet.agents:
        assert await agent.metric("kvroute_agent_redis_errors_total") == 0, agent.log()[-2000:]


def logged_in_users(deployment: Deployment) -> set[str]:
    """The users of the connections open on every node now (CLIENT LIST's user=...)."""
    names = set()
    for port in deployment.ports:
        listing = deployment.admin(port).execute_command("CLIENT", "LIST")
        for line in (listing.decode() if isinstance(listing, bytes) else listing).splitlines():
            names |= {field[5:] for field in line.split() if field.startswith("user=")}
    return names


def assert_denied(error: ResponseError) -> None:
    message = str(error)
    in_script = "The user executing the script can't"  # Redis checks a script's commands against its caller
    assert "NOPERM" in message or "no permissions" in message.lower() or in_script in message, message


async def test_the_router_user_cannot_write_a_worker_record(deployment, users, fleet):
    model = fleet.model
    keys = KeySchema().for_model(model)
    router = client_as(deployment, *users["router"])
    try:

        async def registered() -> bool:
            return len(await RedisIndex(router).workers(model)) == fleet.count

        await wait_until(registered, 30)
        record = keys.worker(fleet.worker_id(0))
        assert await router.hgetall(record)  # it may read the record
        with pytest.raises(ResponseError) as refused:
            await router.hset(record, "url", "http://attacker.invalid:1")
        assert_denied(refused.value)
        with pytest.raises(ResponseError) as refused:  # register.lua, run as the router's user
            await RedisIndex(router).register(WorkerInfo("intruder", model, "http://attacker.invalid:1", 16), 60_000)
        assert_denied(refused.value)
        assert "intruder" not in {w.worker_id for w in await RedisIndex(router).workers(model)}
        assert (await router.hget(record, "url")).decode() == fleet.engines[0].url
    finally:
        await router.aclose()


def test_index_gc_as_the_router_user_says_the_user_is_refused(deployment, users, unique_name):
    """The router's user may read the index, not run its scripts: kvroute index gc as that user is
    one line naming the user and whom to log in as, not a connectivity problem."""
    user, password_file = users["router"]
    command = [sys.executable, "-m", "kvroute", "index", "gc", "--model", unique_name]
    command += ["--redis-url", deployment.url_as(user), "--redis-password-file", str(password_file)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    *_, error = result.stderr.strip().splitlines()  # after the hint that the model has no workers here
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert error.startswith(f"kvroute index gc: error: Redis refused user '{user}'") and "the admin one" in error
