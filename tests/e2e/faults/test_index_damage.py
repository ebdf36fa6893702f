"""The index damaged behind the agents' backs: random block keys deleted (what an eviction under
maxmemory does), and a member no worker owns added to another worker's chain. Every worker's
match must be exactly what the index still holds for it (invariant 2), and the periodic re-assert
must bring the lost entries back."""

from __future__ import annotations

import random
import signal
import time

import pytest

from kvindex.hashing import sequence_hashes
from kvindex.keys import KeySchema
from tests.e2e.faults.measure import MODEL, Scene, open_scene
from tests.e2e.faults.views import engine_blocks, leading_run, route_view
from tests.support import wait_until
from tests.support.traffic import BLOCK

pytestmark = pytest.mark.faults

# The agents' periodic re-assert is what heals deleted keys; they are held (SIGSTOP) while the
# keys are deleted and the matches read, so the TTL covers that.
AGENT_ARGS = ["--reassert-interval", "4", "--ttl-ms", "30000"]


async def delete_segment_keys(scene: Scene, rng: random.Random, share: float) -> dict[int, int]:
    """Delete the segment key of every other probe (its one page: the probes are shorter than a
    page), and ``share`` of all segment keys. Returns each probe's first deleted depth (0: its
    page's key is gone; its length: nothing of it is)."""
    keys = KeySchema().for_model(MODEL)
    chains = [sequence_hashes(probe, BLOCK) for probe in scene.probes]
    segments = [keys.segment(chain[0]).encode() for chain in chains]
    doomed = {segment for p, segment in enumerate(segments) if p % 2 == 0}
    every = [key async for key in scene.client.scan_iter(match=keys.bucket_base("*") + "s:*", count=1000)]
    doomed |= {key for key in every if rng.random() < share}
    await scene.client.delete(*doomed)
    return {p: 0 if segments[p] in doomed else len(chain) for p, chain in enumerate(chains)}


async def match_errors(scene: Scene, first_deleted: dict[int, int]) -> list[str]:
    """Probe credits other than what the index still holds for each worker: the blocks its engine
    holds, up to the first deleted key (nothing inferred past a hole, nobody else's moved)."""
    held = {
        scene.worker(i): await engine_blocks(scene.session, engine.url, BLOCK)
        for i, engine in enumerate(scene.fleet.engines)
    }
    errors = []
    for url in scene.router_urls:
        for p, probe in enumerate(scene.probes):
            chain = sequence_hashes(probe, BLOCK)
            view = await route_view(scene.session, url, probe)
            assert not view.degraded
            for worker, blocks in held.items():
                run = leading_run(chain, blocks)
                credit = view.credits.get(worker, 0)
                if credit != min(run, first_deleted[p]):
                    errors.append(
                        f"probe {p}: {worker} credited {credit}, engine holds {run}, key {first_deleted[p]} gone"
                    )
    return errors


async def test_random_block_keys_deleted(redis_server):
    async with open_scene(redis_server, agent_args=AGENT_ARGS) as scene:
        await scene.prime()
        await scene.traffic.pause()
        await wait_until(scene.caught_up, 10)
        agents = [a.process for a in scene.fleet.agents]
        for process in agents:
            process.send_signal(signal.SIGSTOP)
        try:
            first_deleted = await delete_segment_keys(scene, random.Random(5), share=0.2)
            since = time.monotonic()
            errors = await match_errors(scene, first_deleted)
            lost_at_once = len((await scene.snapshot()).lost)
        finally:
            for process in agents:
                process.send_signal(signal.SIGCONT)
        scene.traffic.resume()
        recovery = await scene.recover(since)
        figures = scene.figures("block_keys_deleted", [recovery], match_errors=len(errors), lost_at_once=lost_at_once)
        assert not errors, errors[:5]
        assert lost_at_once > 0  # the deletion did hit entries the engines hold
        scene.check(figures, [recovery])


async def add_holder(scene: Scene, chain: list[int], depth: int, gid: str) -> None:
    """List ``gid`` by hand as holding ``chain``'s page from its start through block ``depth``
    (the probes are one page long)."""
    key = KeySchema().for_model(MODEL).segment(chain[0])
    for field in (f"e:{chain[depth]:016x}", f"h:{chain[0]:016x}"):
        listed = (await scene.client.hget(key, field) or b",").decode()
        await scene.client.hset(key, field, f"{listed}{gid},")


async def test_a_malformed_entry_leaves_other_workers_matches_exact(redis_server):
    """A holds a probe's 8 blocks, B its first 6; a gid no worker has appears on block 7 alone
    (a corrupt or half-collected entry). A and B must still match 8 and 6."""
    async with open_scene(redis_server) as scene:
        await scene.traffic.pause()
        probe = scene.probes[0]
        for engine, tokens in ((scene.fleet.engines[0], probe), (scene.fleet.engines[1], probe[: 6 * BLOCK])):
            body = {"model": MODEL, "prompt": [*tokens, 5], "max_tokens": 1}
            async with scene.session.post(engine.url + "/v1/completions", json=body) as response:
                assert response.status == 200
        await wait_until(scene.caught_up, 10)
        chain = sequence_hashes(probe, BLOCK)
        await add_holder(scene, chain, 7, "999999")
        errors = []
        for url in scene.router_urls:
            view = await route_view(scene.session, url, probe)
            for i, engine in enumerate(scene.fleet.engines):
                run = leading_run(chain, await engine_blocks(scene.session, engine.url, BLOCK))
                if view.credits.get(scene.worker(i), 0) != run:
                    errors.append(f"{scene.worker(i)} credited {view.credits.get(scene.worker(i))}, holds {run}")
        scene.traffic.resume()
        figures = scene.figures("malformed_entry", [await scene.recover(time.monotonic())], match_errors=len(errors))
        assert not errors, errors
        assert figures.wrong_credits == 0
