"""The simulated engine's hybrid KV cache (sim_engine/hybrid.py: a sliding-window group beside a
full-attention one, as vLLM 0.32's HybridKVCacheCoordinator runs them), against a real vLLM 0.32
capture: tests/fixtures/vllm-0.32-cpu/captures/run5_sliding_window_* (the tiny model with
``layer_types [sliding_attention, full_attention]``, window 64, block size 32, 40 blocks,
max-model-len 400; 36 token-id prompts sent one after another, ``max_tokens`` 2).

The engine is driven step by step (``schedule`` / ``complete``, no event loop), each prompt to its
end before the next, as the capture's requests came. Compared on every request: the cached tokens
vLLM reported (and ``cached_prefix_tokens``, the oracle's view, before it is sent), and the KV
events of its steps, event by event (stores and removals, both groups, evictions in order), equal
up to the engine's hash values: one renaming of hashes fits the whole run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import msgpack
import pytest

from kvevents.vllm import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    decode_message,
    encode_payload,
    encode_seq,
)
from kvindex.hashing import sequence_hashes
from kvindex.reference import ReferenceIndex
from kvindex.types import WorkerInfo
from router.routing.hybrid import hybrid_matches
from sim_engine.block_pool import CacheKeys
from sim_engine.engine import SimEngine, SimRequest, StepPlan, TimingModel
from sim_engine.hybrid import FULL_GROUP, WINDOW_GROUP
from sim_engine.main import build_parser
from sim_engine.settings import SimEngineSettings, settings_from_args
from tests.conftest import CAPTURES
from tests.unit.test_wire import raw_messages
from worker_agent.translate import Translator

BS, WINDOW, BLOCKS, MAX_MODEL_LEN = 32, 64, 40, 400
CAPTURE = "run5_sliding_window_events"


@dataclass
class Served:
    prompt: list[int]
    reported: int  # vLLM's cached_tokens
    cached: int  # the simulation's
    predicted: int  # the simulation's cached_prefix_tokens before it was sent
    real: list[Event]  # vLLM's events between this request and the next
    simulated: list[Event]  # the simulation's, as they read on the wire (encoded, then decoded)
    real_payloads: list[bytes]  # vLLM's messages, as sent
    simulated_payloads: list[bytes]


def hybrid_engine(budget: int = 2048, num_blocks: int = BLOCKS, max_model_len: int = MAX_MODEL_LEN) -> SimEngine:
    timing = TimingModel(max_num_batched_tokens=budget)
    return SimEngine(num_blocks, BS, timing, max_model_len=max_model_len, sliding_window=WINDOW)


def serve(engine: SimEngine, request: SimRequest) -> tuple[list[Event], list[StepPlan]]:
    """Run ``request`` to its end: the events of its steps, and the steps."""
    engine.submit(request)
    events: list[Event] = []
    plans = []
    while not request.finished.is_set():
        plans.append(engine.schedule())
        events += engine.pool.take_events()
        engine.complete(plans[-1])
    return events, plans


def replay_capture() -> Iterator[Served]:
    requests = json.loads((CAPTURES / "run5_sliding_window_http.json").read_text())
    messages = raw_messages(CAPTURE)
    batches = [decode_message(frames) for frames in messages]
    engine = hybrid_engine()
    for number, sent in enumerate(requests):
        until = requests[number + 1]["after_seq"] if number + 1 < len(requests) else float("inf")
        mine = [i for i, b in enumerate(batches) if sent["after_seq"] < b.seq <= until]
        # the capture opens with the reset that emptied the cache before the run
        real: list[Event] = [e for i in mine for e in batches[i].events if not isinstance(e, AllBlocksCleared)]
        predicted = engine.cached_prefix_tokens(sent["prompt"])
        request = SimRequest(f"r{number}", sent["prompt"], max_tokens=2)
        events, _ = serve(engine, request)
        assert request.cached_tokens is not None
        payloads = [encode_payload(events)] if events else []
        simulated: list[Event] = [e for p in payloads for e in decode_message([b"kv", encode_seq(number), p]).events]
        yield Served(
            sent["prompt"],
            sent["cached_tokens"],
            request.cached_tokens,
            predicted,
            real,
            simulated,
            [messages[i][2] for i in mine],
            payloads,
        )


@pytest.fixture(scope="module")
def served() -> list[Served]:
    return list(replay_capture())


def test_every_request_gets_the_cached_tokens_vllm_reported(served):
    assert len(served) == 36
    assert [s.cached for s in served] == [s.reported for s in served]
    assert [s.predicted for s in served] == [s.reported for s in served]  # /debug/match's answer
    assert sum(s.reported > 0 for s in served) >= 20  # hits of every kind: forks, resends, a conversation


class Renaming:
    """One renaming of the simulation's hashes into vLLM's for the whole run (both ways unique)."""

    def __init__(self) -> None:
        self.ours: dict[object, object] = {}
        self.theirs: dict[object, object] = {}

    def same(self, mine: object, real: object) -> bool:
        if mine is None or real is None:
            return mine is real
        return self.ours.setdefault(mine, real) == real and self.theirs.setdefault(real, mine) == mine

    def same_event(self, mine: Event, real: Event) -> bool:
        """Field for field equal (token ids, parents, group, kind, window, extra keys...), but
        for the hash values, which this renaming maps."""
        if type(mine) is not type(real) or len(hashes_of(mine)) != len(hashes_of(real)):
            return False
        names = [f for f in mine.__struct_fields__ if f not in ("block_hashes", "parent_block_hash")]
        if any(getattr(mine, f) != getattr(real, f) for f in names):
            return False
        pairs = [*zip(hashes_of(mine), hashes_of(real), strict=True)]
        pairs.append((getattr(mine, "parent_block_hash", None), getattr(real, "parent_block_hash", None)))
        return all(self.same(a, b) for a, b in pairs)


def hashes_of(event: Event) -> tuple[object, ...]:
    return tuple(getattr(event, "block_hashes", ()))


def test_every_request_publishes_the_events_vllm_published(served):
    renaming = Renaming()
    for number, s in enumerate(served):
        assert len(s.simulated) == len(s.real), (number, s.simulated, s.real)
        for mine, real in zip(s.simulated, s.real, strict=True):
            assert renaming.same_event(mine, real), (number, mine, real)
    events = [e for s in served for e in s.simulated]
    removed = {g: sum(isinstance(e, BlockRemoved) and e.group_idx == g for e in events) for g in (0, 1)}
    stored = {
        g: sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored) and e.group_idx == g) for g in (0, 1)
    }
    assert removed == {WINDOW_GROUP: 43, FULL_GROUP: 82}  # as the capture's, removal by removal
    assert stored == {WINDOW_GROUP: 60, FULL_GROUP: 102}
    empty = [e for e in events if isinstance(e, BlockStored) and not e.block_hashes]
    assert len(empty) == 2 and all(e.group_idx == WINDOW_GROUP and len(e.token_ids) == BS for e in empty)


def test_the_events_carry_vllms_keys_on_the_wire(served):
    """Key for key: a window store that keeps no block has no extra_keys, a full-attention store
    no kv_cache_spec_sliding_window, as vLLM's encoder leaves out what it does not set."""

    def keys(payloads: list[bytes]) -> list[list[str]]:
        return [list(event) for p in payloads for event in msgpack.unpackb(p)[1] if event["type"] != "AllBlocksCleared"]

    for s in served:
        assert keys(s.simulated_payloads) == keys(s.real_payloads)


async def test_the_agent_and_router_predict_the_simulations_hits_from_its_events():
    """The events go through the agent's translation (the same as a real vLLM's) into the index,
    and the router's hybrid hit from it is the engine's cached tokens, on every request."""
    index, translator, real = ReferenceIndex(), Translator(), Translator()
    handle = await index.register(WorkerInfo("w", "tiny", "http://w", BS))
    for s in replay_capture():
        real.translate(s.real)
        chain = sequence_hashes(s.prompt, BS)
        groups = tuple(translator.groups.values())
        if groups:
            matches = await index.match("tiny", chain)
            hits = await hybrid_matches(index, "tiny", groups, chain, len(s.prompt), BS, matches)
            assert hits["w"] * BS == s.cached
        await handle.apply(translator.translate(s.simulated).changes)
    assert translator.counters == real.counters  # blocks and window blocks stored and removed, alike
    assert translator.counters.orphan_runs == 0 and translator.counters.window_blocks_stored == 60


def window_blocks_held(request: SimRequest, engine: SimEngine) -> int:
    return sum(block is not engine.pool.null for block in request.window_blocks)


def test_a_long_prompt_frees_the_blocks_its_window_left_chunk_by_chunk_and_caches_only_its_tail():
    engine = hybrid_engine(budget=64, num_blocks=64, max_model_len=1024)
    prompt = list(range(10, 10 + 10 * BS + 5))  # 10 full blocks and 5 tokens
    request = SimRequest("long", prompt, max_tokens=2)
    engine.submit(request)
    held = []
    events: list[Event] = []
    while not request.finished.is_set():
        plan = engine.schedule()
        held.append(window_blocks_held(request, engine))
        events += engine.pool.take_events()
        engine.complete(plan)
    # the window (63 tokens) and the chunk in flight (64): the blocks before went to the null block
    assert held == [2, 4, 4, 4, 4, 3, 3]
    assert len(request.blocks) == 0 and engine.pool.num_free == 63  # all back, the null block kept
    window = [e for e in events if isinstance(e, BlockStored) and e.group_idx == WINDOW_GROUP]
    assert [len(e.token_ids) // BS for e in window] == [2, 2, 2, 2, 2]  # one span per chunk
    assert [len(e.block_hashes) for e in window] == [0, 0, 0, 0, 2]  # the two blocks before token 324
    assert engine.cached_prefix_tokens(prompt) == 10 * BS
    assert engine.cached_prefix_tokens(prompt[: 6 * BS + 1]) == 0  # no window cached before block 6


def test_a_fork_caches_the_window_at_the_shared_prefix_for_the_next_sibling():
    engine = hybrid_engine()
    base = list(range(100, 100 + 6 * BS))
    serve(engine, SimRequest("a", base + [7] * 40, max_tokens=2))
    second = SimRequest("b", base + [8] * 40, max_tokens=2)
    serve(engine, second)
    assert second.cached_tokens == 0  # the window of the first was cached only at its own end
    third = SimRequest("c", base + [9] * 40, max_tokens=2)
    serve(engine, third)
    assert third.cached_tokens == 6 * BS  # the second cached its window at the junction


def test_preempted_requests_free_both_groups_and_come_back():
    # three short prompts fit at once; their outputs outgrow the cache: the latest admitted goes
    engine = SimEngine(24, BS, TimingModel(max_num_seqs=4), 400, sliding_window=WINDOW)
    requests = [engine.submit(SimRequest(f"r{n}", list(range(n * 300, n * 300 + 40)), 150)) for n in range(3)]
    for _ in range(2000):
        if all(r.finished.is_set() for r in requests):
            break
        plan = engine.schedule()
        for r, _ in plan.scheduled:  # a decode's window (63 tokens back) is in 3 blocks at most
            assert r.prefilling or window_blocks_held(r, engine) <= 3
        engine.complete(plan)
        engine.pool.take_events()
    assert all(len(r.output) == 150 for r in requests)
    assert engine.stats.preemptions > 0 and engine.pool.num_free == 23


def test_the_admission_cap_counts_the_window_groups_blocks_as_vllm_does():
    engine = hybrid_engine(budget=64, num_blocks=BLOCKS, max_model_len=4096)
    # window 63 + 64 in flight: 4 blocks (+1, a window that starts inside a block) at most
    assert engine.kv.max_blocks(30 * BS) == 30 + 5
    with pytest.raises(ValueError, match="more KV blocks than the cache has"):
        engine.submit(SimRequest("huge", [5] * (35 * BS), max_tokens=1))


def test_a_single_group_engine_names_its_one_full_attention_group():
    engine = SimEngine(16, 4, TimingModel())
    events, _ = serve(engine, SimRequest("a", list(range(10, 19)), max_tokens=1, keys=CacheKeys(salt="s")))
    (stored,) = (e for e in events if isinstance(e, BlockStored))
    assert (stored.group_idx, stored.kv_cache_spec_kind, stored.extra_keys) == (0, "full_attention", (["s"], None))
    assert "kv_cache_spec_sliding_window" not in msgpack.unpackb(encode_payload(events))[1][0]


def test_the_sliding_window_setting():
    parser = build_parser()
    assert settings_from_args(parser.parse_args(["--sliding-window", "64"])).sliding_window == 64
    assert settings_from_args(parser.parse_args([])).sliding_window == 0
    with pytest.raises(ValueError, match="cannot be combined"):
        SimEngineSettings(sliding_window=64, cpu_blocks=8)
    with pytest.raises(ValueError, match="--sliding-window must be >= 0"):
        SimEngineSettings(sliding_window=-1)
    with pytest.raises(ValueError, match="cannot be combined"):
        SimEngine(8, 4, TimingModel(), sliding_window=8, cpu_blocks=8)


def test_the_sliding_window_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVROUTE_SIM_SLIDING_WINDOW", "128")
    assert settings_from_args(build_parser().parse_args([])).sliding_window == 128
    assert settings_from_args(build_parser().parse_args(["--sliding-window", "0"])).sliding_window == 0
