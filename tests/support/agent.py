"""What the agent's end-to-end tests share: the stand-in engine's events and the agent's flags."""

from __future__ import annotations

from kvevents.vllm import BlockRemoved, BlockStored
from kvindex.hashing import sequence_hashes
from kvindex.redis_index import RedisIndex
from sim_engine.kv_events import removed_event, stored_event
from tests.support import EngineStandIn, wait_until

BS = 4
TOKENS = list(range(100, 164))  # 16 blocks
CHAIN = sequence_hashes(TOKENS, BS)


def engine_hashes(start: int, stop: int) -> list[int]:
    """The stand-in engine's own block hashes: deliberately unrelated to ours."""
    return [7_000_000 + i for i in range(start, stop)]


def stored(start: int, stop: int, medium: str = "GPU") -> BlockStored:
    parent = engine_hashes(start - 1, start)[0] if start else None
    return stored_event(engine_hashes(start, stop), parent, TOKENS[start * BS : stop * BS], BS, medium=medium)


def removed(*blocks: int, medium: str = "GPU") -> BlockRemoved:
    return removed_event([engine_hashes(b, b + 1)[0] for b in blocks], medium=medium)


def agent_args(engine: EngineStandIn, redis_url: str, replay: bool = True) -> list[str]:
    assert engine.publisher is not None
    args = ["--engine-url", f"{engine.url}/v1", "--events", engine.publisher.endpoint, "--topic", "kv"]
    if replay:
        args += ["--replay", engine.publisher.replay_endpoint or ""]
    return [*args, "--redis-url", redis_url]


async def matched(index: RedisIndex, model: str) -> list[int]:
    return list((await index.match(model, CHAIN)).values())


async def wait_for_match(index: RedisIndex, model: str, expected: list[int], within: float = 10.0) -> float:
    async def check() -> bool:
        return await matched(index, model) == expected

    return await wait_until(check, within)


async def registered(index: RedisIndex, model: str) -> bool:
    return any(r.alive for r in await index.workers(model))
