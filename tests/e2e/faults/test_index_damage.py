"""The index damaged behind the agents' backs: random block keys deleted (what an eviction under
maxmemory does). Every worker's match must stay within what the index still holds for it and
what its engine holds (invariant 2), and the periodic re-assert must bring the lost entries back."""

from __future__ import annotations

import random
import time

import pytest

from kvindex.hashing import sequence_hashes
from kvindex.keys import KeySchema
from tests.e2e.faults.measure import MODEL, Scene, open_scene
from tests.e2e.faults.traffic import BLOCK
from tests.e2e.faults.views import engine_blocks, leading_run, route_view
from tests.support import wait_until

pytestmark = pytest.mark.faults

REASSERT_S = "4"  # the agents' periodic re-assert, the only thing that heals deleted keys


async def delete_block_keys(scene: Scene, rng: random.Random, share: float) -> dict[int, int]:
    """Delete, for probe p, its block at depth 1 + p % 6, and ``share`` of every other block key.
    Returns each probe's first deleted depth."""
    keys = KeySchema().for_model(MODEL)
    doomed: set[bytes] = set()
    first_deleted = {}
    for p, probe in enumerate(scene.probes):
        depth = 1 + p % 6
        doomed.add(keys.block(sequence_hashes(probe, BLOCK)[depth]).encode())
        first_deleted[p] = depth
    every = [key async for key in scene.client.scan_iter(match=keys.block_prefix + "*", count=1000)]
    doomed |= {key for key in every if rng.random() < share}
    await scene.client.delete(*doomed)
    return first_deleted


async def match_errors(scene: Scene, first_deleted: dict[int, int]) -> list[str]:
    """Probe credits outside [what the index still holds, what the engine holds], per worker."""
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
                if not min(run, first_deleted[p]) <= credit <= run:
                    errors.append(
                        f"probe {p}: {worker} credited {credit}, engine holds {run}, key {first_deleted[p]} gone"
                    )
    return errors


async def test_random_block_keys_deleted(redis_server):
    async with open_scene(redis_server, agent_args=["--reassert-interval", REASSERT_S]) as scene:
        await scene.prime()
        await scene.traffic.pause()
        await wait_until(scene.caught_up, 10)
        first_deleted = await delete_block_keys(scene, random.Random(5), share=0.2)
        since = time.monotonic()
        errors = await match_errors(scene, first_deleted)
        lost_at_once = len((await scene.snapshot()).lost)
        scene.traffic.resume()
        recovery = await scene.recover(since)
        figures = scene.figures("block_keys_deleted", [recovery], match_errors=len(errors), lost_at_once=lost_at_once)
        assert not errors, errors[:5]
        assert lost_at_once > 0  # the deletion did hit entries the engines hold
        scene.check(figures, [recovery])


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
        await scene.client.zadd(KeySchema().for_model(MODEL).block(chain[7]), {"999999": 1})
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
