"""An engine that does not say its cache size (``--metrics minimal``: the three load gauges only):
its agent infers the size from the engine's evictions and reports it, so the routers can cost
what a prompt evicts there. A real simulated engine (vLLM's block pool) and a real agent process."""

from __future__ import annotations

import aiohttp

from kvindex.redis_index import RedisIndex
from tests.support import SimFleet, wait_until

NUM_BLOCKS = 24  # 23 usable: block 0 is the null block


async def test_an_engine_reporting_no_cache_size_shows_it_by_its_evictions(server, index: RedisIndex):
    fleet = await SimFleet(
        server.url, count=1, num_blocks=NUM_BLOCKS, engine_metrics="minimal", agent_args=["--block-size", "16"]
    ).start()
    try:
        engine = fleet.engines[0]

        async def load():
            records = [w for w in await index.workers("tiny") if w.worker_id == fleet.worker_id(0)]
            return records[0].load if records and records[0].load is not None else None

        async def loaded() -> bool:
            return await load() is not None

        async with aiohttp.ClientSession() as session:

            async def send(base: int) -> None:
                body = {"model": "tiny", "prompt": list(range(base, base + 8 * 16)), "max_tokens": 1}
                async with session.post(engine.url + "/v1/completions", json=body) as response:
                    assert response.status == 200

            await send(100)
            await send(300)  # 16 blocks held, room for more: no eviction yet
            await wait_until(loaded, 15)
            assert (await load()).capacity_blocks is None
            await send(500)  # 24 blocks wanted: the engine evicts
            await send(700)

            async def size_known() -> bool:
                current = await load()
                return current is not None and current.capacity_blocks is not None

            await wait_until(size_known, 15)
        capacity = (await load()).capacity_blocks
        assert NUM_BLOCKS - 2 <= capacity <= NUM_BLOCKS, capacity  # a lower bound, within a few blocks
    finally:
        await fleet.stop()
