"""Helpers of the end-to-end tests on a real Redis Cluster: prompts whose chains land on chosen
masters, where the index's keys lie, and waits and checks on routing that name the model (the
router tests' helpers assume the model 'tiny'; tests on the shared session cluster use their own)."""

from __future__ import annotations

import asyncio
import random
import shlex
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import aiohttp
import redis
from redis.crc import key_slot

from kvindex.hashing import sequence_hashes
from kvindex.keys import KeySchema
from kvindex.redis_index import RedisIndex
from kvroute.devstack.embedded_cluster import LocalCluster
from kvroute.devstack.embedded_redis import free_port
from tests.support import ROOT, wait_until

BLOCK = 16
PROMPT_BLOCKS = 6


def chain_of(prompt: Sequence[int]) -> list[int]:
    return sequence_hashes(list(prompt), BLOCK)


def bucket_slot(model: str, prompt: Sequence[int]) -> int:
    """The cluster slot of the bucket that holds ``prompt``'s first page (its first block decides:
    the prompts here are one page long)."""
    first_key = KeySchema().for_model(model).segment(chain_of(prompt)[0])
    return key_slot(first_key.encode())


def control_slot(model: str) -> int:
    """The slot of the model's control keys (workers, liveness, records): the tag ``{model}``."""
    return key_slot(KeySchema().for_model(model).alive.encode())


def prompts_on_every_master(cluster: LocalCluster, model: str, per_master: int = 2, seed: int = 5) -> list[list[int]]:
    """Distinct system prompts of PROMPT_BLOCKS full blocks, ``per_master`` of them in buckets on
    each master (drawn until every master has its share), in master order."""
    rng = random.Random(seed)
    by_master: dict[int, list[list[int]]] = {port: [] for port in cluster.master_ports()}
    for _ in range(10_000):
        prompt = [rng.randrange(10, 1900) for _ in range(PROMPT_BLOCKS * BLOCK)]
        chosen = by_master[cluster.master_for_slot(bucket_slot(model, prompt))]
        if len(chosen) < per_master:
            chosen.append(prompt)
        if all(len(prompts) == per_master for prompts in by_master.values()):
            return [prompt for prompts in by_master.values() for prompt in prompts]
    raise AssertionError(f"no prompts found for every master: {[len(p) for p in by_master.values()]}")


def segment_keys_per_master(cluster: LocalCluster, model: str) -> dict[int, int]:
    """How many of ``model``'s segment keys each master holds (read from the master itself)."""
    pattern = KeySchema().for_model(model).bucket_base("*") + "s:*"
    return {
        port: sum(1 for _ in cluster.client(port).scan_iter(match=pattern, count=1000))
        for port in cluster.master_ports()
    }


async def wait_held(index: RedisIndex, model: str, prompt: Sequence[int], worker: str, within: float = 15) -> None:
    """Wait until the index matches all of ``prompt``'s full blocks to ``worker``."""
    chain = chain_of(prompt)

    async def held() -> bool:
        return (await index.match(model, chain)).get(worker) == len(chain)

    await wait_until(held, within)


async def prime(session: aiohttp.ClientSession, engine_url: str, model: str, prompt: Sequence[int]) -> None:
    """Serve ``prompt`` on one engine directly (not through a router): only its cache holds it, and
    no router has an expectation of where it went."""
    body = {"model": model, "prompt": [*prompt, 5], "max_tokens": 1}
    async with session.post(engine_url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()


async def routed_to(session: aiohttp.ClientSession, router_url: str, model: str, prompt: Sequence[int]) -> str:
    """Send a completion through the router; the worker it chose (the reply must be 200)."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": 2}
    async with session.post(router_url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return response.headers["x-kvroute-worker"]


async def index_credits(session: aiohttp.ClientSession, router_url: str, model: str, prompt: Sequence[int]) -> dict:
    """Per worker, the blocks of ``prompt`` the router's index lookup credits (``/debug/route``:
    matched minus pending, so not the router's own recent decisions); {} when degraded."""
    async with session.post(router_url + "/debug/route", json={"model": model, "prompt": list(prompt)}) as response:
        if response.status != 200:
            return {}
        explained = await response.json()
    if explained["degraded"]:
        return {}
    return {w["id"]: w["matched_blocks"] - w["pending_blocks"] for w in explained["workers"]}


async def start_router_process(redis_url: str, *flags: str) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m router`` on a free port with /debug on and ``flags``; returns once /ready."""
    port = free_port()
    command = [sys.executable, "-m", "router", "--redis-url", redis_url, "--port", str(port), "--enable-debug"]
    process = subprocess.Popen([*command, *flags], cwd=ROOT)  # noqa: ASYNC220 - starting it does not block
    url = f"http://127.0.0.1:{port}"

    async def ready() -> bool:
        assert process.poll() is None, f"the router exited with {process.returncode}"
        try:
            async with aiohttp.ClientSession() as session, session.get(url + "/ready") as response:
                return response.status == 200
        except aiohttp.ClientError:
            return False

    try:
        await wait_until(ready, 30)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process, url


def make_acl_user(role: str, user: str, password_file: Path, nodes: Sequence[redis.Redis]) -> None:
    """Create ``user`` with ``role``'s rights from what ``kvroute redis acl`` prints, applied as
    the default user on each of ``nodes`` (ACLs are per node: on a cluster, every node)."""
    printed = subprocess.run(
        [sys.executable, "-m", "kvroute", "redis", "acl", "--role", role, "--user", user,
         "--password-file", str(password_file)],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    (command,) = printed.splitlines()
    words = shlex.split(command)
    assert words[:3] == ["ACL", "SETUSER", user], command
    for node in nodes:
        assert node.execute_command(*words) in (b"OK", "OK", True)


def bounded(check: Callable[[], Awaitable[bool]], seconds: float = 5.0) -> Callable[[], Awaitable[bool]]:
    """``check`` for :func:`~tests.support.wait_until`, taking False for an answer that does not
    come within ``seconds`` (a look at an agent or a router must not outlast the wait itself)."""

    async def looked() -> bool:
        try:
            async with asyncio.timeout(seconds):
                return await check()
        except TimeoutError:
            return False

    return looked
