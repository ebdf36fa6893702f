"""The fault suite's scene and its measurements.

A :class:`Scene` is a private Redis, simulated engines with agent processes, router replicas and
shared-prefix :class:`~tests.support.traffic.Traffic`; each engine is also primed with probe
prefixes of its own (never sent as traffic), so that crediting one worker with another's blocks
shows. A scenario breaks something, then
:meth:`Scene.recover` measures, against each engine's own view of its cache:

* failed requests: every request of the traffic that did not come back 200;
* recovery: seconds from the end of the fault until routing quality is back, i.e. every router
  credits each probe prefix to a worker whose engine holds it, with exactly the blocks it holds,
  and that is the most any engine holds;
* wrong credits: a worker credited with a block its engine does not hold, by the index (every block
  any engine held, read fresh from Redis) or by a router (the probes), counted only when the
  agents have applied every batch their engines published (no event lag) and still wrong at the
  next look (not a write in flight);
* lost entries: blocks an engine holds (with their whole chain) that the index does not credit to
  its worker, once the traffic is paused and the agents caught up.

Each scenario prints one ``FIGURES`` line (run with ``-s``) and, when KVROUTE_FAULT_FIGURES names
a file, appends the figures there as a JSON line (docs/reliability.md's table comes from those).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field

import aiohttp
from redis.asyncio import Redis
from redis.exceptions import RedisError

from kvindex.hashing import sequence_hashes
from kvroute.devstack.embedded_redis import RedisServer
from router.main import RunningRouter
from tests.e2e.faults.views import engine_block_parents, index_blocks, leading_run, route_view
from tests.support import SimFleet, wait_for_workers
from tests.support.router import start_router
from tests.support.traffic import BLOCK, Traffic, make_prefixes

MODEL = "tiny"
POLL_S = 0.1


@dataclass
class Snapshot:
    caught_up: bool = False
    quality: bool = False
    wrong: set[tuple] = field(default_factory=set)
    lost: set[tuple] = field(default_factory=set)
    why: list[str] = field(default_factory=list)  # why quality is not back (for failure messages)

    @property
    def clean(self) -> bool:
        return self.caught_up and self.quality and not self.wrong and not self.lost


@dataclass
class Figures:
    scenario: str
    requests: int
    failed: int
    recovery_s: float | None
    wrong_credits: int
    lost_entries: int
    notes: dict = field(default_factory=dict)

    def line(self) -> str:
        recovery = "never" if self.recovery_s is None else f"{self.recovery_s:.2f}"
        notes = " ".join(f"{k}={v}" for k, v in self.notes.items())
        return (
            f"FIGURES {self.scenario}: requests={self.requests} failed={self.failed} recovery_s={recovery} "
            f"wrong_credits={self.wrong_credits} lost_entries={self.lost_entries} {notes}".rstrip()
        )

    def report(self) -> Figures:
        print(self.line(), flush=True)
        path = os.environ.get("KVROUTE_FAULT_FIGURES")
        if path:
            with open(path, "a") as out:
                out.write(json.dumps(asdict(self)) + "\n")
        return self


@dataclass
class Recovery:
    seconds: float | None
    wrong: int
    lost: int
    last: Snapshot


@dataclass
class Scene:
    redis: RedisServer
    fleet: SimFleet
    routers: list[RunningRouter]
    traffic: Traffic
    probes: list[list[int]]  # prefixes primed straight into the engines, never sent as traffic
    client: Redis
    session: aiohttp.ClientSession
    dead: set[int] = field(default_factory=set)  # engines killed on purpose (their cache is gone)
    seen: dict[int, int | None] = field(default_factory=dict)  # every index hash an engine held -> its parent
    extra_router_urls: list[str] = field(default_factory=list)  # router processes, checked too

    @property
    def router_urls(self) -> list[str]:
        return [r.url for r in self.routers] + self.extra_router_urls

    def worker(self, index: int) -> str:
        return self.fleet.worker_id(index)

    async def prime(self) -> None:
        """Put probe k into engine k's cache (k modulo the live engines), straight to the engine:
        each engine holds different probes, so crediting one worker with another's blocks shows.
        Called again before each fault, so that the traffic does not evict them (LRU)."""
        live = [e for i, e in enumerate(self.fleet.engines) if i not in self.dead]
        for k, probe in enumerate(self.probes):
            body = {"model": MODEL, "prompt": [*probe, 5], "max_tokens": 1}
            async with self.session.post(live[k % len(live)].url + "/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()

    # --- looking ------------------------------------------------------------------------------

    async def caught_up(self) -> bool:
        """Every live engine's agent runs and has applied the last batch its engine published."""
        for i, engine in enumerate(self.fleet.engines):
            if i in self.dead:
                continue
            agent = self.fleet.agents[i]
            if agent.process is None or agent.process.poll() is not None:
                return False
            try:
                async with asyncio.timeout(2):
                    last = await agent.metric("kvroute_agent_last_seq")
            except TimeoutError:
                return False
            if last != engine.publisher.next_seq - 1:
                return False
        return True

    async def snapshot(self, count_dead: bool = True) -> Snapshot:
        """Compare the three views now. ``count_dead=False``: a killed engine's credits do not
        count yet (its worker stays until the agent or the heartbeat TTL says it is gone)."""
        snap = Snapshot(caught_up=await self.caught_up())
        held: dict[str, set[int]] = {}
        for i, engine in enumerate(self.fleet.engines):
            parents = {} if i in self.dead else await engine_block_parents(self.session, engine.url, BLOCK)
            held[self.worker(i)] = set(parents)
            self.seen.update(parents)
        chains = [sequence_hashes(p, BLOCK) for p in self.probes]
        for chain in chains:
            self.seen.update(zip(chain, [None, *chain[:-1]], strict=True))
        try:
            async with asyncio.timeout(3):
                indexed = await index_blocks(self.client, MODEL, self.seen)
        except (RedisError, OSError, TimeoutError) as exc:
            snap.why.append(f"index unreadable: {type(exc).__name__}")
            return snap
        dead_workers = {self.worker(i) for i in self.dead}
        for worker, blocks in indexed.items():
            if count_dead or worker not in dead_workers:
                snap.wrong |= {("index", worker, b) for b in blocks - held.get(worker, set())}
        for worker, blocks in held.items():
            if worker not in dead_workers:
                snap.lost |= {(worker, b) for b in blocks - indexed.get(worker, set())}
        snap.quality = True
        for worker in dead_workers & set(indexed):  # failure detection: the worker must leave first
            snap.quality = False
            snap.why.append(f"killed {worker} still alive in the index")
        for url in self.router_urls:
            for p, chain in enumerate(chains):
                runs = {w: leading_run(chain, blocks) for w, blocks in held.items()}
                await self._route_check(snap, url, p, runs, dead_workers, count_dead)
        return snap

    async def _route_check(
        self,
        snap: Snapshot,
        url: str,
        p: int,
        runs: dict[str, int],
        dead_workers: set[str],
        count_dead: bool,
    ) -> None:
        """Probe ``p`` through the router at ``url``: wrong credits into ``snap``, and whether the
        router credits it the way the engines hold it (``runs``: each worker's leading blocks)."""
        try:
            view = await route_view(self.session, url, self.probes[p])
        except (aiohttp.ClientError, TimeoutError) as exc:
            view = None
            snap.why.append(f"{url} unreachable: {exc}")
        if view is None or view.degraded:
            snap.quality = False
            snap.why.append(f"{url} degraded for probe {p}")
            return
        for worker, credit in view.credits.items():
            if credit > runs.get(worker, 0) and (count_dead or worker not in dead_workers):
                snap.wrong.add(("route", url, p, worker, credit, runs.get(worker, 0)))
        best = max((run for w, run in runs.items() if w not in dead_workers), default=0)
        top = max(view.credits.items(), key=lambda item: item[1], default=(None, 0))
        credited_dead = any(view.credits.get(w, 0) for w in dead_workers)
        if top[1] != best or (best and runs.get(top[0], 0) != best) or credited_dead:
            snap.quality = False
            snap.why.append(f"{url} probe {p}: credits {view.credits}, engines hold {runs}")

    # --- recovering ---------------------------------------------------------------------------

    async def quality_back(self, since: float, within: float = 30.0) -> tuple[float | None, Snapshot]:
        """Seconds from ``since`` until routing quality is back (traffic may run); None: never."""
        deadline = time.monotonic() + within
        snap = Snapshot()
        while time.monotonic() < deadline:
            snap = await self.snapshot(count_dead=False)
            if snap.quality:
                return time.monotonic() - since, snap
            await asyncio.sleep(POLL_S)
        return None, snap

    async def settle(self, within: float = 20.0) -> tuple[int, Snapshot]:
        """Pause the traffic and look until all is clean (or ``within`` runs out): the most wrong
        credits seen in two looks in a row with the agents caught up, and the last look."""
        await self.traffic.pause()
        deadline = time.monotonic() + within
        previous: set[tuple] | None = None
        worst = 0
        snap = Snapshot()
        while time.monotonic() < deadline:
            snap = await self.snapshot()
            if snap.caught_up:
                if previous is not None:
                    worst = max(worst, len(_persistent(previous, snap.wrong)))
                previous = snap.wrong
                if snap.clean:
                    break
            await asyncio.sleep(POLL_S)
        return worst, snap

    async def recover(self, since: float, within: float = 30.0) -> Recovery:
        """Measure one recovery, then let the traffic go on."""
        seconds, quality = await self.quality_back(since, within)
        wrong, last = await self.settle()
        self.traffic.resume()
        if seconds is None:  # keep the look that says why quality never came back
            last = quality
        return Recovery(seconds, wrong, len(last.lost), last)

    def figures(self, scenario: str, recoveries: list[Recovery], **notes) -> Figures:
        times = [r.seconds for r in recoveries]
        return Figures(
            scenario,
            self.traffic.sent,
            self.traffic.failed,
            None if None in times else max(t for t in times if t is not None),
            max(r.wrong for r in recoveries),
            max(r.lost for r in recoveries),
            notes,
        ).report()

    def check(self, figures: Figures, recoveries: list[Recovery], requests_must_succeed: bool = True) -> None:
        worst = next((r for r in recoveries if r.seconds is None or r.wrong or r.lost), recoveries[-1])
        detail = f"{figures.line()}\nfailures: {self.traffic.failures}\nlast look: {_describe(worst.last)}"
        if requests_must_succeed:
            assert figures.failed == 0, detail
        assert figures.recovery_s is not None, detail
        assert figures.wrong_credits == 0, detail
        assert figures.lost_entries == 0, detail


def _persistent(previous: set[tuple], now: set[tuple]) -> set[tuple]:
    """Wrong credits seen in both looks (route entries compared without their counts)."""
    return {w for w in now if w[:4] in {p[:4] for p in previous}}


def _describe(snap: Snapshot) -> str:
    wrong = sorted(snap.wrong, key=str)[:5]
    lost = sorted(snap.lost, key=str)[:5]
    return (
        f"caught_up={snap.caught_up} quality={snap.quality} wrong={len(snap.wrong)} {wrong} "
        f"lost={len(snap.lost)} {lost} why={snap.why[:4]}"
    )


@contextlib.asynccontextmanager
async def open_scene(
    redis: RedisServer,
    engines: int = 3,
    routers: int = 1,
    num_blocks: int = 512,
    agent_args: list[str] | None = None,
    warmup: int = 60,
    router_redis_url: str | None = None,
    engine_kinds: Sequence[str] = (),
    **router_settings,
) -> AsyncIterator[Scene]:
    """A running scene with warm caches: ``warmup`` requests served and routing quality reached.
    ``router_redis_url``: where the routers find Redis (a proxy in front of it), if not direct.
    ``engine_kinds``: engine i speaks engine_kinds[i]'s KV events ("vllm", "sglang"; its pages are
    the index's blocks, so its holdings compare block for block)."""
    async with contextlib.AsyncExitStack() as stack:
        fleet = SimFleet(
            redis.url, count=engines, num_blocks=num_blocks, agent_args=agent_args or [], engine_kinds=engine_kinds
        )
        stack.push_async_callback(fleet.stop)
        await fleet.start()
        running = []
        for _ in range(routers):
            context, router = await start_router(router_redis_url or redis.url, **router_settings)
            stack.push_async_callback(context.__aexit__, None, None, None)  # type: ignore[attr-defined]
            await wait_for_workers(router, engines)
            running.append(router)
        traffic = Traffic([r.url for r in running], make_prefixes(2 * engines, seed=13))
        stack.push_async_callback(traffic.stop)
        client = Redis.from_url(redis.url, socket_timeout=2, socket_connect_timeout=1)
        stack.push_async_callback(client.aclose)
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        stack.push_async_callback(session.close)
        scene = Scene(redis, fleet, running, traffic, make_prefixes(2 * engines, seed=99), client, session)
        traffic.start()
        await traffic.progressed(warmup)
        await scene.prime()
        seconds, snap = await scene.quality_back(time.monotonic())
        assert seconds is not None, f"no routing quality before any fault: {_describe(snap)}"
        yield scene
