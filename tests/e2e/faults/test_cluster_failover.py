"""A Redis Cluster failing over under traffic: a replica taking over (CLUSTER FAILOVER) from the
master of the model's control slot and from a master holding only buckets, and a master killed
(SIGKILL; its replica is elected). Each test has a cluster of its own. Twelve clients keep sending
shared-prefix completions through the router all along: none may fail. Afterwards every agent has
re-asserted, each probe prompt (primed straight into one engine, on every master) is matched to
its worker again, and the index agrees with the engines' caches block for block."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import aiohttp
import pytest
import redis

from kvindex.cluster import RedisClient
from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvroute.devstack.embedded_cluster import LocalCluster
from kvroute.devstack.embedded_redis import RedisServer, default_server_binary
from router.main import RunningRouter
from tests.e2e.faults.views import engine_block_parents, index_blocks, leading_run
from tests.support import SimFleet, wait_for_workers, wait_until
from tests.support.cluster import (
    BLOCK,
    bounded,
    chain_of,
    control_slot,
    index_credits,
    make_acl_user,
    prime,
    prompts_on_every_master,
    segment_keys_per_master,
    start_router_process,
    wait_held,
)
from tests.support.router import start_router
from tests.support.traffic import Traffic, make_prefixes

pytestmark = pytest.mark.faults

MODEL = "tiny"  # the traffic's model
CLIENTS = 12
REASSERT_REASONS = "kvroute_agent_reasserts_total{reason="


@dataclass
class ClusterScene:
    cluster: LocalCluster
    fleet: SimFleet
    router: RunningRouter
    traffic: Traffic
    client: RedisClient
    session: aiohttp.ClientSession
    probes: list[tuple[list[int], str]] = field(default_factory=list)  # (prompt, the worker it was primed on)
    seen: dict[int, int | None] = field(default_factory=dict)  # every block an engine held -> its parent
    extra_router_urls: list[str] = field(default_factory=list)  # router processes, sent traffic and checked too

    @property
    def router_urls(self) -> list[str]:
        return [self.router.url, *self.extra_router_urls]

    @property
    def index(self) -> RedisIndex:
        return RedisIndex(self.client)

    async def reasserts(self) -> list[dict[str, float]]:
        """Each agent's re-asserts so far, by reason (each agent must answer within 5 s)."""
        counts = []
        for agent in self.fleet.agents:
            async with asyncio.timeout(5):
                metrics = await agent.metrics()
            counts.append({name: value for name, value in metrics.items() if name.startswith(REASSERT_REASONS)})
        return counts

    async def caught_up(self) -> bool:
        """Every agent has applied the last batch its engine published."""
        for agent, engine in zip(self.fleet.agents, self.fleet.engines, strict=True):
            if await agent.metric("kvroute_agent_last_seq") != engine.publisher.next_seq - 1:
                return False
        return True

    async def prime(self) -> None:
        """Serve probe k on its engine again (before a fault: so that the traffic's LRU evictions
        leave it there) and wait until the index has it."""
        for prompt, worker in self.probes:
            await prime(self.session, self.fleet.engine_of(worker).url, MODEL, prompt)
            await wait_held(self.index, MODEL, prompt, worker)

    async def probes_matched(self) -> bool:
        """The index and the router credit each probe to its worker with the blocks its engine
        holds now (all of them, unless the traffic evicted some since it was primed)."""
        for prompt, worker in self.probes:
            chain = chain_of(prompt)
            held = leading_run(
                chain, set(await engine_block_parents(self.session, self.fleet.engine_of(worker).url, BLOCK))
            )
            if (await self.index.match(MODEL, chain)).get(worker) != held:
                return False
            for url in self.router_urls:
                if (await index_credits(self.session, url, MODEL, prompt)).get(worker) != held:
                    return False
        return True

    async def index_agrees(self) -> bool:
        """With the agents caught up: no wrong credit and no lost entry (the traffic paused)."""
        if not await self.caught_up():
            return False
        held = {
            self.fleet.worker_id(i): await engine_block_parents(self.session, engine.url, BLOCK)
            for i, engine in enumerate(self.fleet.engines)
        }
        assert all(held.values()), "an engine holds nothing: the comparison would prove nothing"
        for blocks in held.values():  # a credit left on a block no engine holds any more is wrong too
            self.seen.update(blocks)
        indexed = await index_blocks(self.client, MODEL, self.seen)
        wrong = {(w, b) for w, blocks in indexed.items() for b in blocks if b not in held.get(w, {})}
        lost = {(w, b) for w, blocks in held.items() for b in blocks if b not in indexed.get(w, set())}
        return not wrong and not lost


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster() as started:
        yield started


@contextlib.asynccontextmanager
async def cluster_scene(
    cluster: LocalCluster,
    agent_url: str | None = None,
    agent_args: Sequence[str] = (),
    router_processes: Sequence[Sequence[str]] = (),
    **router: str | float,
) -> AsyncIterator[ClusterScene]:
    """Engines with agents (on ``agent_url``, by default the cluster's), a router in this process
    (its settings: ``router``, ``url`` among them), a ``python -m router`` process on the cluster
    for each of ``router_processes`` (its flags), and the traffic running through every router."""
    async with contextlib.AsyncExitStack() as stack:
        fleet = SimFleet(agent_url or cluster.url, count=3, num_blocks=512, agent_args=list(agent_args))
        stack.push_async_callback(fleet.stop)
        await fleet.start()
        context, running = await start_router(str(router.pop("url", cluster.url)), **router)
        stack.push_async_callback(context.__aexit__, None, None, None)  # type: ignore[attr-defined]
        await wait_for_workers(running, fleet.count, MODEL, fleet=fleet)
        extra_router_urls = []
        for flags in router_processes:
            process, url = await start_router_process(cluster.url, *flags)
            stack.callback(_terminated, process)
            extra_router_urls.append(url)
        client = RedisSettings(url=cluster.url).client()
        stack.push_async_callback(client.aclose)
        session = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)))
        traffic = Traffic([running.url, *extra_router_urls], make_prefixes(6, seed=13), concurrency=CLIENTS)
        stack.push_async_callback(traffic.stop)
        scene = ClusterScene(cluster, fleet, running, traffic, client, session, extra_router_urls=[*extra_router_urls])
        probes = prompts_on_every_master(cluster, MODEL, per_master=1, seed=99)
        scene.probes = [(prompt, fleet.worker_id(k % fleet.count)) for k, prompt in enumerate(probes)]
        traffic.start()
        await traffic.progressed(60)
        yield scene


def _terminated(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    assert process.wait(15) == 0, f"the router process exited with {process.returncode}"


@pytest.fixture
async def scene(cluster: LocalCluster) -> AsyncIterator[ClusterScene]:
    async with cluster_scene(cluster) as opened:
        yield opened


async def recovered(scene: ClusterScene) -> None:
    """No request failed; the probes are matched to their workers again (by the index and the
    router); with the traffic paused, the index agrees with the engines block for block."""
    await wait_until(bounded(scene.probes_matched), 30, interval=0.2)
    await scene.traffic.pause()
    try:
        await wait_until(bounded(scene.index_agrees, 10), 30, interval=0.2)
    finally:
        scene.traffic.resume()
    assert scene.traffic.failed == 0, scene.traffic.failures


async def survive(scene: ClusterScene, fault, port: int) -> int:
    """Run ``fault(port)`` (a blocking LocalCluster call, in a thread: the traffic runs on) and
    check the recovery: every agent re-asserted, then :func:`recovered`. Returns what the fault
    returned."""
    await scene.prime()
    before = await scene.reasserts()
    served = scene.traffic.completed
    new_port = await asyncio.to_thread(fault, port)
    during = scene.traffic.completed - served
    assert during > 0  # requests were served while the cluster failed over
    degraded_at_end = scene.router.state.decider.degraded_count
    await scene.traffic.progressed(60)  # and go on through the new topology
    degraded_after = scene.router.state.decider.degraded_count - degraded_at_end

    async def everyone_reasserted() -> bool:
        now = await scene.reasserts()
        return all(sum(n.values()) > sum(b.values()) for n, b in zip(now, before, strict=True))

    await wait_until(bounded(everyone_reasserted), 30, interval=0.2)
    reasons = {name for counts in await scene.reasserts() for name in counts}
    await recovered(scene)
    degraded = scene.router.state.decider.degraded_count
    figures = f"served_during_fault={during} degraded={degraded} degraded_after_fault={degraded_after}"
    print(f"FIGURES {fault.__name__}: {figures} reasserts={sorted(reasons)}", flush=True)
    return new_port


async def test_failovers_of_the_control_master_and_of_a_bucket_master(scene: ClusterScene):
    cluster = scene.cluster
    control = cluster.master_for_slot(control_slot(MODEL))
    buckets = next(port for port, count in segment_keys_per_master(cluster, MODEL).items() if port != control and count)
    await survive(scene, cluster.failover, control)
    assert cluster.master_for_slot(control_slot(MODEL)) != control
    await survive(scene, cluster.failover, buckets)
    print(f"FIGURES cluster_failover: requests={scene.traffic.sent} failed={scene.traffic.failed}", flush=True)


async def test_the_control_master_killed(scene: ClusterScene):
    cluster = scene.cluster
    control = cluster.master_for_slot(control_slot(MODEL))
    promoted = await survive(scene, cluster.kill_master, control)
    assert cluster.master_for_slot(control_slot(MODEL)) == promoted
    print(f"FIGURES cluster_kill_master: requests={scene.traffic.sent} failed={scene.traffic.failed}", flush=True)


async def test_a_bucket_master_killed(scene: ClusterScene):
    cluster = scene.cluster
    control = cluster.master_for_slot(control_slot(MODEL))
    buckets = next(port for port, count in segment_keys_per_master(cluster, MODEL).items() if port != control and count)
    await survive(scene, cluster.kill_master, buckets)
    print(f"FIGURES cluster_kill_bucket_master: requests={scene.traffic.sent} failed={scene.traffic.failed}")


async def test_least_privilege_users_through_a_failover_and_a_killed_master(cluster: LocalCluster, tmp_path):
    """The ACL users of ``kvroute redis acl`` (on every node) have what a failover takes: slot
    map refreshes, every master's INFO, re-asserts. No node logs a denied command."""
    passwords = {role: tmp_path / f"{role}.pw" for role in ("agent", "router")}
    for role, path in passwords.items():
        path.write_text(f"{role}-pw\n")
        make_acl_user(role, f"kvr-{role}", path, [cluster.client(port) for port in cluster.nodes])
    nodes = cluster.url.split("://", 1)[1]
    agent_url, router_url = f"redis+cluster://kvr-agent@{nodes}", f"redis+cluster://kvr-router:router-pw@{nodes}"
    agent_args = ["--redis-password-file", str(passwords["agent"])]
    async with cluster_scene(cluster, agent_url, agent_args, url=router_url) as scene:
        control = cluster.master_for_slot(control_slot(MODEL))
        await survive(scene, cluster.failover, control)
        await survive(scene, cluster.kill_master, cluster.master_for_slot(control_slot(MODEL)))
    for port, role in cluster.nodes.items():
        if role != "down":
            assert cluster.client(port).execute_command("ACL", "LOG") == [], port


async def test_a_router_reading_from_replicas_through_a_failover_and_a_killed_master(cluster: LocalCluster):
    async with cluster_scene(cluster, router_processes=[["--read-from-replicas"]]) as scene:
        control = cluster.master_for_slot(control_slot(MODEL))
        buckets = next(p for p, n in segment_keys_per_master(cluster, MODEL).items() if p != control and n)
        await survive(scene, cluster.failover, buckets)  # its replica, read from, becomes the master
        await survive(scene, cluster.kill_master, control)


async def test_every_master_paused_routes_by_round_robin_then_by_the_cache_again(cluster: LocalCluster):
    """Redis there but answering nothing for 3 s (every master paused, longer than the agents'
    heartbeat TTL): the router routes without it (degraded), then by the index again."""
    async with cluster_scene(cluster, redis_timeout_s=0.05) as scene:
        await scene.prime()
        degraded = scene.router.state.decider.degraded_count
        for port in cluster.master_ports():
            cluster.client(port).execute_command("CLIENT", "PAUSE", 3000, "ALL")
        await scene.traffic.progressed(30)  # decided while the masters were paused
        assert scene.router.state.decider.degraded_count > degraded
        await recovered(scene)


@pytest.fixture(params=["single", "cluster"])
def index_url(request: pytest.FixtureRequest) -> Iterator[tuple[str, int, redis.Redis]]:
    """A private single Redis or cluster: (URL, port of the model's control keys, a client there)."""
    if request.param == "single":
        server = RedisServer(binary=default_server_binary()).start()
        client = redis.Redis(port=server.port, decode_responses=True)
        yield server.url, server.port, client
        client.close()
        server.stop()
        return
    with LocalCluster() as cluster:
        control = cluster.master_for_slot(control_slot(MODEL))
        yield cluster.url, control, cluster.client(control)


async def test_a_briefly_paused_control_shard_degrades_no_decision(index_url):
    url, _, client = index_url
    fleet = await SimFleet(url, count=3).start()
    context, router = await start_router(url)
    try:
        await wait_for_workers(router, fleet.count, MODEL)
        prompts = make_prefixes(40, seed=3)
        client.execute_command("CLIENT", "PAUSE", 800, "ALL")  # slower than usual, well within the 2 s budget
        async with aiohttp.ClientSession() as session:
            statuses = await asyncio.gather(*(_status(session, router.url, prompt) for prompt in prompts))
        assert statuses == [200] * len(prompts)
        assert router.state.decider.degraded_count == 0
    finally:
        await context.__aexit__(None, None, None)  # type: ignore[attr-defined]
        await fleet.stop()


async def _status(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> int:
    async with session.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}) as reply:
        return reply.status
