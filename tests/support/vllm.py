"""A real vLLM server (CPU build, the tiny model) for the `-m vllm` suites.

`.ci/vllm-env` builds the vLLM environment; docs/sim-engine.md ("Against a real vLLM") says how
vLLM runs on a CPU-only machine. The model directory vLLM loads is put together for each server
in its temporary directory: the weights and config from tests/fixtures/vllm-0.32-cpu/tiny-model/,
the tokenizer files from sim_engine/tiny_model/ (the very files the simulated engine and the
router tokenize with).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvindex.settings import RedisSettings
from kvroute.devstack import vllm as devstack_vllm
from kvroute.devstack.embedded_redis import free_port
from kvroute.devstack.vllm import BLOCK_SIZE, VllmOptions, vllm_command, vllm_env
from kvservice.lifecycle import StartupError
from router.main import RunningRouter, running_router
from router.settings import RouterSettings
from sim_engine.settings import TINY_MODEL_DIR
from tests.conftest import FIXTURES
from tests.support import AgentProcess, wait_until

MODEL = "tiny"
BS = BLOCK_SIZE
WEIGHTS_DIR = FIXTURES / "tiny-model"  # config.json, generation_config.json, model.safetensors


def vllm_python() -> Path:
    try:
        return devstack_vllm.vllm_python()
    except StartupError as exc:
        pytest.fail(str(exc))


def assemble_model(directory: Path, config: Mapping[str, Any] | None = None) -> Path:
    """The tiny model as one directory, as vLLM loads it (:func:`kvroute.devstack.vllm.assemble_model`)."""
    return devstack_vllm.assemble_model(directory, config)


# The tiny model as a hybrid: its first layer a sliding window of 64 tokens (two blocks of 32 make
# a hit), its second full attention; vLLM keeps a KV-cache group for each.
SLIDING_WINDOW_CONFIG = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}


@dataclass
class VllmServer:
    process: subprocess.Popen[bytes]
    port: int
    events_port: int
    replay_port: int
    workdir: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _command(
    model: Path, port: int, events_port: int, replay_port: int, num_blocks: int, max_model_len: int = 256
) -> list[str]:
    vllm_python()  # a missing environment fails the test with its message
    options = VllmOptions(num_blocks=num_blocks, max_model_len=max_model_len)
    return vllm_command(model, port, events_port, replay_port, options)


@contextmanager
def vllm_server(
    num_blocks: int = 12,
    max_model_len: int = 256,
    extra_args: Sequence[str] = (),
    config: Mapping[str, Any] | None = None,
) -> Iterator[VllmServer]:
    """A fresh server with a ``num_blocks`` KV cache, KV events and replay on, until the block
    exits; ``extra_args`` are more vLLM flags (scheduler limits, say); ``config`` changes the
    model's config.json (:func:`assemble_model`)."""
    workdir = tempfile.mkdtemp(prefix="kvroute-vllm-")
    port, events_port, replay_port = distinct_free_ports(3)
    env = vllm_env(workdir)
    try:
        command = _command(
            assemble_model(Path(workdir), config), port, events_port, replay_port, num_blocks, max_model_len
        )
        command += list(extra_args)
        with open(f"{workdir}/server.log", "wb") as log:
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        server = VllmServer(process, port, events_port, replay_port, workdir)
        try:
            _wait_healthy(server)
            yield server
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# Run by the vLLM environment's Python: a random LoRA adapter (rank 8 on q_proj and v_proj) of
# the tiny model, made with peft as a user would make a real one.
_MAKE_ADAPTER = """
import sys, torch
from transformers import AutoModelForCausalLM
from peft import LoraConfig, get_peft_model
model_dir, out, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(seed)
config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config).save_pretrained(out)
"""


def make_lora_adapters(directory: Path, names: Sequence[str]) -> dict[str, Path]:
    """A random LoRA adapter of the tiny model per name, in ``directory``; name -> its directory."""
    model = assemble_model(directory)
    adapters = {}
    for seed, name in enumerate(names, 1):
        out = directory / name
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
        command = [str(vllm_python()), "-c", _MAKE_ADAPTER, str(model), str(out), str(seed)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            pytest.fail(f"making the LoRA adapter {name} failed (is peft in the vLLM environment?):\n{done.stderr}")
        adapters[name] = out
    return adapters


def distinct_free_ports(count: int) -> list[int]:
    """``count`` free ports, all different: free_port() can hand out the same port twice (CI once
    gave vLLM's HTTP and KV-event sockets one port, and vLLM never became healthy)."""
    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


def _wait_healthy(server: VllmServer, within: float = 300.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            log = Path(server.workdir, "server.log").read_text()[-4000:]
            pytest.fail(f"vLLM exited with {server.process.returncode}:\n{log}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)  # polling a process that takes ~25 s to start: not synchronization
    pytest.fail(f"vLLM was not healthy within {within} s")


async def sees_the_worker(running: RunningRouter) -> bool:
    """Whether the router lists the tiny model's worker alive (agent_and_router's usual readiness)."""
    return bool(running.state.fleet.alive(MODEL))


@asynccontextmanager
async def agent_and_router(
    vllm: VllmServer, redis_url: str, prefix: str, ready: Callable[[RunningRouter], Awaitable[bool]]
) -> AsyncIterator[RunningRouter]:
    """An agent following ``vllm`` and a router (in this process) tokenizing with the tiny model,
    on the index under ``prefix``; yielded once ``ready(router)`` (after a refresh of its fleet)."""
    events, replay = f"tcp://127.0.0.1:{vllm.events_port}", f"tcp://127.0.0.1:{vllm.replay_port}"
    args = ["--engine-url", f"{vllm.url}/v1", "--events", events, "--replay", replay, "--topic", "kv"]
    agent = AgentProcess([*args, "--redis-url", redis_url, "--prefix", prefix]).start()
    redis = RedisSettings(url=redis_url, prefix=prefix)
    settings = RouterSettings(redis=redis, port=0, tokenizers=((MODEL, TINY_MODEL_DIR),))
    try:
        async with running_router(settings) as running:

            async def refreshed_and_ready() -> bool:
                await running.state.fleet.refresh()
                return await ready(running)

            await wait_until(refreshed_and_ready, 60)
            yield running
    finally:
        agent.kill()
