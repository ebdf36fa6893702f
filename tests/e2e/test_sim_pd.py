"""Prefill/decode disaggregation between two simulated engine processes (``--kv-transfer``): the
prefill leg sent to one, the decode leg with its reply's ``kv_transfer_params`` to the other, by
hand over HTTP as vLLM's disaggregated-serving proxies send them; the KV pulled between them over
their private endpoint (sim_engine/kv_transfer.py), the KV events read back from their replay
sockets."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from kvevents.vllm import BlockStored, Event, decode_message
from kvroute.devstack.embedded_redis import free_port
from sim_engine.kv_events import END_SEQ
from tests.support import ROOT, decode_leg, prefill_leg, wait_until

BS = 16
PROMPT = [(i * 37) % 1800 + 20 for i in range(70)]  # 4 full blocks and 6 tokens more
CHAT = {"messages": [{"role": "user", "content": "Tell me about disaggregated serving, at length."}]}
INTERNAL_ERROR = {
    "error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
}


@dataclass
class EngineProcess:
    process: subprocess.Popen[bytes]
    url: str
    replay_endpoint: str
    log: Path

    def output(self) -> str:
        return self.log.read_text()

    async def metrics(self) -> dict[str, float]:
        async with aiohttp.ClientSession() as session, session.get(self.url + "/metrics") as response:
            text = await response.text()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                source = sample.labels.get("source")
                samples[f"{sample.name}{{{source}}}" if source else sample.name] = sample.value
        return samples

    async def events(self) -> list[Event]:
        """Every KV event the engine still buffers, from its replay socket."""
        context = zmq.asyncio.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        events: list[Event] = []
        try:
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            while (frames := await asyncio.wait_for(dealer.recv_multipart(), 10))[2] != END_SEQ:
                events += decode_message(frames[1:]).events
        finally:
            dealer.close(linger=0)
            context.term()
        return events


def start_engine(flags: tuple[str, ...]) -> EngineProcess:
    port, events, replay = free_port(), free_port(), free_port()
    log = Path(tempfile.mkstemp(prefix="kvroute-sim-pd-", suffix=".log")[1])
    argv = [
        *(sys.executable, "-m", "sim_engine", "--port", str(port), "--kv-transfer"),
        *("--events-endpoint", f"tcp://127.0.0.1:{events}", "--replay-endpoint", f"tcp://127.0.0.1:{replay}"),
        *("--topic", "kv", "--num-blocks", "64", "--block-size", str(BS), "--speedup", "50", *flags),
    ]
    with log.open("wb") as output:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
    return EngineProcess(process, f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", log)


def stop_engine(engine: EngineProcess) -> None:
    if engine.process.poll() is None:
        engine.process.terminate()
        engine.process.wait(10)
    engine.log.unlink(missing_ok=True)


@asynccontextmanager
async def engine_process(*flags: str) -> AsyncIterator[EngineProcess]:
    """``python -m sim_engine --kv-transfer`` on free ports, serving once /health answers."""
    engine = start_engine(flags)

    async def serving() -> bool:
        assert engine.process.poll() is None, engine.output()
        try:
            async with aiohttp.ClientSession() as session, session.get(engine.url + "/health") as response:
                return response.status == 200
        except aiohttp.ClientError:
            return False

    try:
        await wait_until(serving, within=30)
        yield engine
    finally:
        stop_engine(engine)


def stored(events: list[Event]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


async def sse(response: aiohttp.ClientResponse) -> list[Any]:
    """A server-sent event stream's data, decoded (``[DONE]`` as the string)."""
    text = await response.text()
    return [json.loads(e[6:]) if e[6:] != "[DONE]" else "[DONE]" for e in text.split("\n\n") if e.startswith("data: ")]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "return_token_ids": True}),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}),
    ],
    ids=["completions, whole", "chat, streamed"],
)
async def test_a_request_split_over_two_engines(path, body):
    body = {"model": "tiny", **body}
    async with engine_process() as prefill, engine_process("--kv-transfer-ms-per-1k-tokens", "50") as decode:
        async with aiohttp.ClientSession() as session:
            prefilled = await prefill_leg(session, prefill.url, body, path)
            params = prefilled["kv_transfer_params"]
            prompt_tokens = prefilled["usage"]["prompt_tokens"]
            assert params["remote_port"] == int(prefill.url.rsplit(":", 1)[1]) and params["remote_host"] == "127.0.0.1"
            assert params["remote_num_tokens"] == prompt_tokens and params["remote_prefill_cached_tokens"] == 0
            assert len(params["remote_block_ids"][0]) == -(-prompt_tokens // BS)
            assert (await prefill.metrics())["vllm:kv_cache_usage_perc"] > 0  # held for the decode engine
            async with session.post(decode.url + path, json=decode_leg(body, prefilled)) as response:
                assert response.status == 200
                if body.get("stream"):
                    chunks = await sse(response)
                    assert chunks[-1] == "[DONE]" and chunks[0]["choices"][0]["delta"] == {
                        "role": "assistant",
                        "content": "",
                    }
                    usage = chunks[-2]["usage"]
                else:
                    reply = await response.json()
                    assert reply["kv_transfer_params"] is None and len(reply["choices"][0]["token_ids"]) == 5
                    usage = reply["usage"]
        assert usage == {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + 5,
            "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 0},  # the prefill engine's hit, as vLLM reports
        }
        on_prefill, on_decode = await prefill.metrics(), await decode.metrics()
        assert on_prefill["vllm:kv_cache_usage_perc"] == 0  # pulled: freed there
        assert on_prefill["vllm:generation_tokens_total"] == 1 and on_decode["vllm:generation_tokens_total"] == 5
        assert on_decode["vllm:prompt_tokens_by_source_total{external_kv_transfer}"] == prompt_tokens
        assert on_decode["vllm:prompt_tokens_by_source_total{local_compute}"] == 0
        prefill_stores, decode_stores = stored(await prefill.events()), stored(await decode.events())
        (prefilled_blocks,) = prefill_stores
        assert len(prefilled_blocks.token_ids) == prompt_tokens // BS * BS  # its full blocks, computed there
        pulled = decode_stores[0]  # the pulled ones, announced by the decode engine (then decode's own)
        assert pulled.token_ids == prefilled_blocks.token_ids and pulled.parent_block_hash is None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_decode_leg_fails_as_vllm_when_the_prefill_engine_is_gone(stream):
    body: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": stream}
    async with engine_process() as prefill, engine_process() as decode:
        async with aiohttp.ClientSession() as session:
            prefilled = await prefill_leg(session, prefill.url, body)
            prefill.process.kill()
            prefill.process.wait(10)
            async with session.post(decode.url + "/v1/completions", json=decode_leg(body, prefilled)) as response:
                if stream:  # vLLM has sent 200 already: the error is an event, then [DONE]
                    assert response.status == 200 and await sse(response) == [INTERNAL_ERROR, "[DONE]"]
                else:
                    assert (response.status, await response.json()) == (500, INTERNAL_ERROR)
            assert "KV load failed" in decode.output()
            on_decode = await decode.metrics()
            assert on_decode["vllm:kv_cache_usage_perc"] == 0 and on_decode["vllm:num_requests_waiting"] == 0
            assert on_decode["vllm:prompt_tokens_total"] == 0  # it never got a first token
            async with session.post(decode.url + "/v1/completions", json={**body, "stream": False}) as response:
                assert response.status == 200 and (await response.json())["usage"]["completion_tokens"] == 4
        assert stored(await decode.events())  # it computed the prompt itself, once asked without a prefill
