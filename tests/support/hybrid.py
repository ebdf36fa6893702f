"""A hybrid model's requests (the tiny model with a sliding window of 64 beside full attention,
blocks of 32, a 40-block cache): shared prefixes that fork, strangers and cuts of the shared
start that evict, a growing conversation, then the forks again. The sequence of
tests/e2e/test_vllm_hybrid.py (a real vLLM), for the simulated engine's tests/e2e/test_sim_hybrid.py;
and the wait for the index to hold a prompt."""

from __future__ import annotations

import random

import aiohttp

from kvindex.groups import is_hybrid
from kvindex.hashing import sequence_hashes
from router.main import RunningRouter
from tests.support import wait_until


def hybrid_prompts() -> list[list[int]]:
    rng = random.Random(11)
    base = [rng.randrange(5, 2000) for _ in range(300)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(5, 2000) for _ in range(n)]

    forks = [base[:200] + tail(40), base[:200] + tail(60), base[:150] + tail(70), base[:300], base[:100] + tail(40)]
    out = [*forks]
    for _ in range(6):  # pressure: strangers, and the shared start cut at other places
        out += [tail(rng.randrange(60, 300)), base[: rng.choice([64, 100, 130, 200, 260, 300])] + tail(20)]
    conversation = base[:90]
    for _ in range(5):
        conversation = conversation + tail(rng.randrange(20, 50))
        out.append(conversation)
    return out + forks


async def wait_hybrid_indexed(router: RunningRouter, prompt: list[int], model: str, block_size: int) -> None:
    """Until the index holds the prompt's full blocks (the engine cached them: its events, both
    groups' in one batch, went through the agent) and the router knows the model's groups."""
    chain = sequence_hashes(prompt, block_size)

    async def indexed() -> bool:
        await router.state.fleet.refresh()
        matched = (await router.state.index.lookup(model, chain)).matches
        return max(matched.values(), default=0) >= len(chain) and is_hybrid(router.state.fleet.kv_groups(model))

    await wait_until(indexed, 30)


async def hybrid_outcome(
    session: aiohttp.ClientSession, router: RunningRouter, prompt: list[int], model: str, block_size: int
) -> tuple[int, int, int]:
    """Send ``prompt`` through the router and wait until the index holds it: (predicted, reported
    cached tokens, and what the full-attention group alone would have predicted)."""
    full = (await router.state.index.lookup(model, sequence_hashes(prompt, block_size))).matches
    full_only = min(max(full.values(), default=0) * block_size, (len(prompt) - 1) // block_size * block_size)
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    async with session.post(router.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        predicted = int(response.headers["x-kvroute-cached-tokens"])
        reply = await response.json()
    await wait_hybrid_indexed(router, prompt, model, block_size)
    return predicted, reply["usage"]["prompt_tokens_details"]["cached_tokens"], full_only
