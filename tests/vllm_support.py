"""A real vLLM server (CPU build, the shared tiny model) for the `-m vllm` suites.

See ../shared/docs/vllm-on-cpu.md; `.ci/vllm-env` builds the vLLM environment.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvroute.embedded_redis import free_port
from tests.conftest import SHARED

MODEL = "tiny"
BS = 32
TINY_MODEL = Path(SHARED) / "fixtures" / "vllm-0.32-cpu" / "tiny-model"
DEFAULT_VENV = Path.home() / ".cache" / "kvroute" / "vllm-cpu-venv"


def vllm_python() -> Path:
    venv = Path(os.environ.get("KVROUTE_VLLM_VENV", DEFAULT_VENV))
    python = venv / "bin" / "python"
    if not python.exists():
        pytest.fail(f"no vLLM environment at {venv}: run .ci/vllm-env (or set KVROUTE_VLLM_VENV)")
    return python


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


@contextmanager
def vllm_server(num_blocks: int = 12) -> Iterator[VllmServer]:
    """A fresh server with a ``num_blocks`` KV cache, KV events and replay on, until the block exits."""
    workdir = tempfile.mkdtemp(prefix="kvroute-vllm-")
    port, events_port, replay_port = free_port(), free_port(), free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1", TMPDIR=workdir,
               VLLM_CACHE_ROOT=f"{workdir}/cache", TORCHINDUCTOR_CACHE_DIR=f"{workdir}/inductor")  # fmt: skip
    kv_events = {
        "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
        "endpoint": f"tcp://*:{events_port}", "replay_endpoint": f"tcp://*:{replay_port}",
    }  # fmt: skip
    command = [
        str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(TINY_MODEL),
        "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--enable-prefix-caching",
        "--block-size", str(BS), "--max-model-len", "256", "--num-gpu-blocks-override", str(num_blocks),
        "--enforce-eager",
        "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(kv_events),
    ]  # fmt: skip
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
        shutil.rmtree(workdir, ignore_errors=True)


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
        time.sleep(1)
    pytest.fail(f"vLLM was not healthy within {within} s")
