"""LoRA adapters, checked against a real vLLM 0.32 capture (tests/fixtures/.../run4_lora_*): the
agent reads the adapters from /v1/models and hashes an adapter's blocks as the router hashes its
prompts; the simulated engine announces an adapter's blocks key for key as vLLM does."""

from __future__ import annotations

import json

import pytest

from kvevents.vllm import BlockStored, decode_message
from kvindex.hashing import sequence_hashes
from kvindex.types import StoredRun
from kvtokens.tokenizer import ModelPrompts
from sim_engine import api
from sim_engine.block_pool import BlockPool, CacheKeys
from sim_engine.lora import LoraAdapters, LoraError, parse_module
from sim_engine.settings import TINY_MODEL_DIR
from tests.conftest import CAPTURES
from tests.unit.test_wire import raw_messages
from worker_agent.engine import parse_models
from worker_agent.translate import Translator

PROMPT = list(range(100, 180))  # the capture's prompt: two full blocks of 32 and 16 tokens more
BS = 32


def captured_stores() -> list[BlockStored]:
    return [e for frames in raw_messages("run4_lora_events") for e in decode_message(frames).events]  # type: ignore[misc]


def test_the_real_listing_names_the_base_model_and_its_adapter():
    served = parse_models(json.loads((CAPTURES / "run4_lora_models.json").read_text()))
    assert served.bases == ("tiny",) and served.adapters_of("tiny") == ("sql-lora",)


def test_the_agent_hashes_a_real_adapters_blocks_as_the_router_hashes_the_prompt():
    """Base, adapter, adapter with a salt, a second adapter: four chains, each the router's."""
    translator = Translator(BS)
    runs = [change for e in captured_stores() for change in translator.translate([e]).changes]
    expected = [
        sequence_hashes(PROMPT, BS),
        sequence_hashes(PROMPT, BS, lora_name="sql-lora"),
        sequence_hashes(PROMPT, BS, lora_name="sql-lora", cache_salt="s1"),
        sequence_hashes(PROMPT, BS, lora_name="chat-lora"),
    ]
    assert runs == [StoredRun(None, tuple(chain)) for chain in expected]
    assert len({chain[0] for chain in expected}) == 4  # four identities, four chains
    assert translator.counters.unsupported_extra_keys == 0


def test_the_simulated_engine_announces_an_adapters_blocks_as_vllm_does():
    real = [e for e in captured_stores() if e.lora_name == "sql-lora"]
    for captured, keys in zip(real, (CacheKeys(None, "sql-lora", 1), CacheKeys("s1", "sql-lora", 1)), strict=True):
        pool = BlockPool(8, BS)
        blocks = pool.allocate(2)
        pool.cache(blocks, [11, 12], PROMPT, 0, keys)
        (sim,) = pool.take_events()
        assert isinstance(sim, BlockStored)
        same = ("token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx")
        assert all(getattr(sim, name) == getattr(captured, name) for name in same), (sim, captured)


def test_a_request_names_the_base_model_or_a_served_adapter():
    prompts = ModelPrompts(TINY_MODEL_DIR)
    adapters = LoraAdapters([parse_module("sql-lora=/adapters/sql")])
    body = {"model": "sql-lora", "prompt": [5, 6, 7], "cache_salt": "s"}
    generation = api.parse_completion(body, "tiny", prompts, adapters)
    assert generation.lora is not None and generation.keys == CacheKeys("s", "sql-lora", 1)
    assert api.parse_completion({**body, "model": "tiny"}, "tiny", prompts, adapters).keys == CacheKeys("s")
    with pytest.raises(api.ApiError, match="The model `chat-lora` does not exist"):
        api.parse_completion({**body, "model": "chat-lora"}, "tiny", prompts, adapters)


def test_adapters_load_and_unload_as_vllm_answers():
    adapters = LoraAdapters([("sql-lora", "/a")])
    assert adapters.load("chat-lora", "/b").lora_id == 2
    with pytest.raises(LoraError, match="already been loaded") as loaded:
        adapters.load("chat-lora", "/b")
    assert loaded.value.status == 400
    adapters.unload("chat-lora")
    with pytest.raises(LoraError, match="cannot be found") as missing:
        adapters.unload("chat-lora")
    assert missing.value.status == 404
    assert [a.name for a in adapters] == ["sql-lora"] and adapters.load("again", "/c").lora_id == 3
    for bad in ("no-path", "=path", "name="):
        with pytest.raises(ValueError, match="NAME=PATH"):
            parse_module(bad)
