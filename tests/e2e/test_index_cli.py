"""`kvroute index ...` as a user runs it: a real process against a real private Redis."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from redis.asyncio import Redis

from kvindex.hashing import sequence_hashes
from kvindex.keys import bucket_of
from kvindex.redis_index import RedisIndex
from kvindex.types import StoredRun, WorkerInfo
from kvtokens.tokenizer import ModelPrompts
from sim_engine.settings import TINY_MODEL_DIR

TOKENS = list(range(1, 129))  # 4 blocks of 32


GROUPS = "0:sliding_window:32:64,1:full_attention:32:"  # a hybrid model's KV-cache groups (kvindex/groups.py)


def kvroute(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvroute", *args], capture_output=True, text=True, timeout=60)


async def populate(url: str, model: str) -> None:
    client = Redis.from_url(url)
    index = RedisIndex(client)
    chain = sequence_hashes(TOKENS, 32)
    await index.register(WorkerInfo("w-long", model, "http://127.0.0.1:9001", 32), 600_000)
    await index.register(WorkerInfo("w-short", model, "http://127.0.0.1:9002", 32, 1, ("sql-lora",)), 600_000)
    await index.register(WorkerInfo("w-dead", model, "http://127.0.0.1:9003", 32, role="prefill"), 600_000)
    await index.handle(model, "w-long").store([StoredRun(None, tuple(chain))])
    await index.handle(model, "w-long").set_kv_groups(GROUPS)
    await index.handle(model, "w-short").store([StoredRun(None, tuple(chain[:1]))])
    await index.handle(model, "w-dead").store([StoredRun(None, tuple(chain))])
    await index.handle(model, "w-dead").heartbeat(0)
    await client.aclose()


def test_hash_prints_the_public_json_shape():
    result = kvroute("index", "hash", "--tokens", "1,2,3,4", "--block-size", "4", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "block_size": 4,
        "hashes": [14643705804678351452],
        "hashes_hex": ["cb38e4d7fb2dca5c"],
    }
    salted = json.loads(
        kvroute("index", "hash", "--tokens", "[1,2,3,4]", "--block-size", "4", "--salt", "s", "--json").stdout
    )
    assert salted["hashes"] == sequence_hashes([1, 2, 3, 4], 4, cache_salt="s")


def test_a_prompt_given_as_text_is_tokenized_with_the_models_tokenizer():
    """No token ids at hand: --text with --tokenizer gives the same hashes as the ids it tokenizes to."""
    text = kvroute("index", "hash", "--text", "hello world", "--tokenizer", str(TINY_MODEL_DIR), "--block-size", "1")
    ids = ModelPrompts(TINY_MODEL_DIR).encode("hello world")
    by_ids = kvroute("index", "hash", "--tokens", ",".join(map(str, ids)), "--block-size", "1")
    assert text.returncode == 0 and text.stdout == by_ids.stdout, text.stderr
    alone = kvroute("index", "hash", "--text", "hello", "--block-size", "1")
    assert alone.returncode == 2 and "--text needs --tokenizer DIR" in alone.stderr
    both = kvroute("index", "hash", "--text", "x", "--tokens", "1", "--block-size", "1")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


async def populate_tiers(url: str, model: str) -> None:
    """A worker holding one block on its GPU and the whole chain in its CPU tier's holder."""
    client = Redis.from_url(url)
    index = RedisIndex(client)
    chain = sequence_hashes(TOKENS, 32)
    gpu = await index.register(WorkerInfo("w", model, "http://127.0.0.1:9001", 32), 600_000)
    cpu = await index.register(
        WorkerInfo("w#cpu", model, "http://127.0.0.1:9001", 32, tier="CPU", tier_of="w"), 600_000
    )
    await gpu.store([StoredRun(None, tuple(chain[:1]))])
    await cpu.store([StoredRun(None, tuple(chain))])
    await client.aclose()


def test_a_workers_tiers_are_listed_and_looked_up(redis_server, unique_name):
    asyncio.run(populate_tiers(redis_server.url, unique_name))
    common = ["--redis-url", redis_server.url, "--model", unique_name]
    workers = json.loads(kvroute("index", "workers", *common, "--json").stdout)
    tiers = {w["id"]: (w["tier"], w["tier_of"], w["blocks"]) for w in workers}
    assert tiers == {"w": ("GPU", None, 1), "w#cpu": ("CPU", "w", 4)}
    table = kvroute("index", "workers", *common).stdout
    assert "tier" in table.splitlines()[0] and "CPU" in table
    tokens = ",".join(map(str, TOKENS))
    found = json.loads(kvroute("index", "lookup", *common, "--tokens", tokens, "--json").stdout)
    assert {w["id"]: w["matched_blocks"] for w in found["workers"]} == {"w": 1, "w#cpu": 4}


def test_lookup_workers_and_stats_show_the_index(redis_server, unique_name):
    asyncio.run(populate(redis_server.url, unique_name))
    tokens = ",".join(map(str, TOKENS))
    common = ["--redis-url", redis_server.url]
    result = kvroute("index", "lookup", *common, "--model", unique_name, "--tokens", tokens, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    chain = sequence_hashes(TOKENS, 32)
    assert data["model"] == unique_name and data["block_size"] == 32
    assert [b["hash"] for b in data["blocks"]] == chain
    assert [b["index"] for b in data["blocks"]] == [0, 1, 2, 3]
    # the blocks' page is in the segment key named by its first block, whose bucket is in the hash tag
    segment = f"kvr:{{{unique_name}#{bucket_of(chain[0]):03x}}}:s:{chain[0]:016x}"
    assert [(b["key"], b["page"]) for b in data["blocks"]] == [(segment, 0)] * 4
    assert [b["owners"] for b in data["blocks"]] == [["w-long", "w-short"], ["w-long"], ["w-long"], ["w-long"]]
    assert data["workers"] == [{"id": "w-long", "matched_blocks": 4}, {"id": "w-short", "matched_blocks": 1}]

    workers = json.loads(kvroute("index", "workers", *common, "--model", unique_name, "--json").stdout)
    by_id = {w["id"]: w for w in workers}
    assert set(by_id) == {"w-long", "w-short", "w-dead"}
    assert by_id["w-dead"]["alive"] is False and by_id["w-long"]["blocks"] == 4
    assert by_id["w-short"]["dp_rank"] == 1 and by_id["w-short"]["url"] == "http://127.0.0.1:9002"
    assert by_id["w-short"]["adapters"] == ["sql-lora"] and by_id["w-long"]["adapters"] == []
    assert by_id["w-long"]["kv_groups"] == GROUPS and by_id["w-short"]["kv_groups"] == ""
    assert (by_id["w-dead"]["role"], by_id["w-long"]["role"]) == ("prefill", "both")
    listed = kvroute("index", "workers", *common, "--model", unique_name).stdout
    assert "adapters" in listed.splitlines()[0] and "sql-lora" in listed
    assert "role" in listed.splitlines()[0] and "prefill" in listed

    stats = json.loads(kvroute("index", "stats", *common, "--model", unique_name, "--json").stdout)
    (model_stats,) = stats["models"]
    assert (model_stats["workers"], model_stats["alive_workers"], model_stats["entries"]) == (3, 2, 9)
    assert (model_stats["pages"], model_stats["block_keys"]) == (1, 0) and stats["redis"]["used_memory"] > 0

    found = json.loads(kvroute("index", "lookup", *common, "--model", unique_name, "--tokens", tokens, "--json").stdout)
    assert all(block["hash_hex"] == f"{block['hash']:016x}" for block in found["blocks"])  # exact in jq
    table = kvroute("index", "lookup", *common, "--model", unique_name, "--tokens", tokens)
    assert table.returncode == 0 and "w-long" in table.stdout and "matched_blocks" in table.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["index", "hash", "--tokens", "1,x", "--block-size", "4"], "token ids must be integers"),
        (["index", "hash", "--tokens", "1,2", "--block-size", "0"], "positive integer"),
        (["index", "hash", "--tokens", "-5", "--block-size", "4"], "0..4294967295"),
        (["index", "lookup", "--tokens", "1"], "--model"),
        (["index", "nope"], "invalid choice"),
    ],
)
def test_bad_arguments_get_a_clear_message(args, message):
    result = kvroute(*args)
    assert result.returncode == 2
    assert message in result.stderr
