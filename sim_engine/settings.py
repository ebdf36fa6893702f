"""The simulated engine's settings: one frozen dataclass whose fields declare their flags and
KVROUTE_SIM_* variables (kvservice.declared); argparse, the environment's reading and
docs/sim-engine.md's table are made from it."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kvservice.declared import Kind, add_declared, nested, of_type, read_declared, setting
from kvservice.logs import LogSettings
from sim_engine.engine import TimingModel
from sim_engine.kv_transfer import DEFAULT_MS_PER_1K_TOKENS, DEFAULT_TIMEOUT_S
from sim_engine.lora import parse_module

# The tokenizer and chat template of the tiny model that tests/fixtures/vllm-0.32-cpu was captured
# with (no weights): text prompts tokenize exactly as that real vLLM server's did.
TINY_MODEL_DIR = Path(__file__).resolve().parent / "tiny_model"

# --events-endpoint's default: a port that follows the HTTP port, so engines started with
# different --port values never collide; 5557 (vLLM's usual KV-event port) for the default 8000.
AUTO = "auto"
EVENTS_PORT_OFFSET = 8000 - 5557
FIRST_EVENTS_PORT = 1024  # derived ports below this would need privileges
METRICS_MODES = ("full", "minimal")
ENGINE_KINDS = ("vllm", "sglang", "trtllm")  # the engine imitated: its KV-event wire, metric names, owned_by
WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def default_events_endpoint(port: int, host: str = "127.0.0.1") -> str:
    """``tcp://<host>:<port - 2443>`` (a free port for ``--port 0``), bound on the HTTP address:
    loopback unless ``--host`` says otherwise (a wildcard host: ``tcp://*:...``)."""
    address = "*" if host in WILDCARD_HOSTS else f"[{host}]" if ":" in host else host
    if port == 0:
        return f"tcp://{address}:*"
    events_port = port - EVENTS_PORT_OFFSET
    if events_port < FIRST_EVENTS_PORT:
        raise ValueError(
            f"--port {port} has no default KV-event port (--port - {EVENTS_PORT_OFFSET} is below "
            f"{FIRST_EVENTS_PORT}): pass --events-endpoint tcp://*:PORT, or none"
        )
    return f"tcp://{address}:{events_port}"


@dataclass(frozen=True)
class SimEngineSettings:
    VARIABLE_PREFIX: ClassVar[str] = "KVROUTE_SIM_"  # its settings' variables (kvservice.declared)

    host: str = setting("127.0.0.1", flag="--host", help="the HTTP address")
    port: int = setting(8000, flag="--port", parse=of_type(int), help="the HTTP port (0 picks a free one)")
    events_endpoint: str | None = setting(
        AUTO,
        flag="--events-endpoint",
        metavar="ENDPOINT",
        parse=lambda _, text: _events_endpoint(text),
        help="the ZMQ PUB endpoint of KV events: bound when it is a wildcard like tcp://*:5557, connected otherwise "
        f"(as vLLM); none: no events; auto: bound on --host at tcp://<host>:<--port - {EVENTS_PORT_OFFSET}> "
        "(tcp://127.0.0.1:5557 for port 8000, a free port for --port 0, tcp://*:... for --host 0.0.0.0)",
    )  # AUTO becomes default_events_endpoint(port, host); None: no events
    events_bind: bool = False  # bind events_endpoint whatever it names (the default's); else vLLM's rule
    replay_endpoint: str | None = setting(
        None,
        flag="--replay-endpoint",
        metavar="ENDPOINT",
        shown_default="off",
        help="the ZMQ ROUTER endpoint of replay (DEALER-compatible, with vLLM's end marker); needs events",
    )
    topic: str = setting("", flag="--topic", help="the KV-event topic")
    model: str = setting("tiny", flag="--model", help="the served model name")
    tokenizer: Path = setting(
        TINY_MODEL_DIR,
        flag="--tokenizer",
        metavar="DIR",
        parse=lambda _, text: Path(text),
        shown_default="the bundled tiny model (sim_engine/tiny_model: the tokenizer and chat template of the model the "
        "real-vLLM captures were made with, no weights)",
        help="a model directory with tokenizer.json and a chat template",
    )
    num_blocks: int = setting(
        2048,
        flag="--num-blocks",
        parse=of_type(int),
        help="KV blocks (block 0 is vLLM's null block: N blocks hold N - 1)",
    )
    block_size: int = setting(16, flag="--block-size", parse=of_type(int), help="tokens per block")
    max_model_len: int = setting(
        4096, flag="--max-model-len", parse=of_type(int), help="the context length served: prompt + max_tokens"
    )
    dp_rank: int = setting(
        0,
        flag="--dp-rank",
        parse=of_type(int),
        help="the rank in events (data_parallel_rank) and metrics (the engine label)",
    )
    buffer_steps: int = setting(10_000, flag="--buffer-steps", parse=of_type(int), help="batches kept for replay")
    drop_events_every: int = setting(
        0,
        flag="--drop-events-every",
        parse=of_type(int),
        help="fault injection: every Nth KV-event batch is kept for replay but not sent, so subscribers see sequence "
        "gaps (0: send all)",
    )
    timing: TimingModel = nested(TimingModel)
    # "full": vLLM's whole metric set on /metrics; "minimal": only the running, waiting and
    # KV-usage gauges (an engine, or an older vLLM, that reports little). /debug/metrics is full.
    metrics: str = setting(
        "full",
        flag="--metrics",
        choices=METRICS_MODES,
        help="what /metrics exports: full (vLLM's names) or minimal (only vllm:num_requests_running, "
        "vllm:num_requests_waiting and vllm:kv_cache_usage_perc, as an engine that reports little); /debug/metrics "
        "always has the full set",
    )
    # "vllm", or "sglang": SGLang's KV-event wire (kvevents/sglang.py: a block is a page of
    # --block-size tokens), its /metrics names and owned_by in /v1/models
    engine_kind: str = setting(
        "vllm",
        flag="--engine-kind",
        choices=ENGINE_KINDS,
        help="the engine imitated: its KV-event wire, /metrics names and /v1/models owned_by (sglang: a block is a "
        "page of --block-size tokens, 1 being SGLang's default page, its sglang:* metric names and owned_by sglang; "
        "trtllm: TensorRT-LLM's events, queued up to --buffer-steps and drained by POST /kv_cache_events, JSON "
        "iteration stats on GET /metrics, its Prometheus page on /prometheus/metrics, owned_by tensorrt_llm); "
        "/debug/metrics keeps vLLM's names. Not with --sliding-window or --kv-transfer; trtllm not with "
        "--cpu-blocks or --disk-blocks",
    )
    # LoRA adapters served from the start (NAME, PATH), and whether they may be loaded and
    # unloaded at run time (vLLM's --enable-lora with VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    lora_modules: tuple[tuple[str, str], ...] = setting(
        (),
        flag="--lora-modules",
        kind=Kind.LIST,
        many=True,
        metavar="NAME=PATH",
        parse=lambda _, text: parse_module(text),
        help="LoRA adapters served from the start, as vLLM's flag (requests name them as the model); they imply "
        "--enable-lora",
    )
    enable_lora: bool = setting(
        False,
        flag="--enable-lora",
        kind=Kind.SWITCH,
        help="also load and unload adapters at run time (/v1/load_lora_adapter, /v1/unload_lora_adapter)",
    )
    # A CPU tier behind the GPU cache (vLLM's native CPU offloading): its size in blocks (0: none)
    # and its load time (sim_engine/offload.py).
    cpu_blocks: int = setting(
        0,
        flag="--cpu-blocks",
        parse=of_type(int),
        help="a CPU tier of this many blocks behind the GPU cache, as vLLM's CPU offloading (0: none)",
    )
    cpu_load_ms_per_1k_tokens: float = setting(
        4.0,
        flag="--cpu-load-ms-per-1k-tokens",
        parse=of_type(float),
        help="the CPU tier's load time per 1k tokens (the default: an 8B model's KV over PCIe Gen5)",
    )
    # A disk tier behind it (LMCache's local-disk backend; without a CPU tier: right behind the
    # GPU cache): its size in blocks (0: none) and its load time (sim_engine/offload.py).
    disk_blocks: int = setting(
        0,
        flag="--disk-blocks",
        parse=of_type(int),
        help="a disk tier of this many blocks behind the CPU tier (or the GPU cache without one), as LMCache's "
        "local-disk backend (0: none)",
    )
    disk_load_ms_per_1k_tokens: float = setting(
        30.0,
        flag="--disk-load-ms-per-1k-tokens",
        parse=of_type(float),
        help="the disk tier's load time per 1k tokens (the default: an 8B model's KV from a local NVMe drive)",
    )
    # A hybrid model's KV cache (sim_engine/hybrid.py): a sliding-window group of this many tokens
    # beside the full-attention one, as vLLM keeps for layer_types [sliding_attention,
    # full_attention]; 0: one full-attention group.
    sliding_window: int = setting(
        0,
        flag="--sliding-window",
        metavar="TOKENS",
        parse=of_type(int),
        help="a hybrid model's KV cache: a sliding-window group of this many tokens beside the full-attention one, "
        "sharing the blocks, as vLLM runs layer_types [sliding_attention, full_attention] (0: full attention only); "
        "not with --cpu-blocks or --disk-blocks",
    )
    # Prefill/decode disaggregation (sim_engine/kv_transfer.py): every engine can serve either leg,
    # as vLLM's NIXL connector with kv_role kv_both; a pull takes this long per 1k tokens; a
    # finished prefill keeps its blocks this long unless a decode engine holding a request for
    # them renews the lease (vLLM's kv_lease_duration); the host its replies name for pulls
    # (None: --host, or localhost when that is a wildcard).
    kv_transfer: bool = setting(
        False,
        flag="--kv-transfer",
        kind=Kind.SWITCH,
        help="prefill/decode disaggregation as vLLM's NIXL connector (kv_both): a request's kv_transfer_params make "
        "it a prefill leg that keeps its KV for a decode engine, or a decode leg that pulls it from one (off: "
        "kv_transfer_params are ignored); not with --cpu-blocks, --disk-blocks or --sliding-window",
    )
    kv_transfer_ms_per_1k_tokens: float = setting(
        DEFAULT_MS_PER_1K_TOKENS,
        flag="--kv-transfer-ms-per-1k-tokens",
        metavar="MS",
        parse=of_type(float),
        help="a decode leg's pull of its prompt's KV takes this long per 1k tokens pulled, divided by --speedup "
        "(the default: an 8B model's KV over RDMA)",
    )
    kv_transfer_timeout_s: float = setting(
        DEFAULT_TIMEOUT_S,
        flag="--kv-transfer-timeout-s",
        metavar="S",
        parse=of_type(float),
        help="a finished prefill leg keeps its blocks this long (wall clock) for a decode engine, renewed while a "
        "decode engine holds a request for them (vLLM's kv_lease_duration)",
    )
    kv_transfer_host: str | None = setting(
        None,
        flag="--kv-transfer-host",
        metavar="HOST",
        shown_default="--host, or localhost when it is a wildcard",
        help="the host a prefill reply names for the decode engine's pull (remote_host; the port is --port's)",
    )
    # Engines that share their compute (sim_engine/shared_compute.py): those started with the same
    # directory share this many cores, as vLLM servers on one CPU do; None: a step's time alone.
    shared_compute: Path | None = setting(
        None,
        flag="--shared-compute",
        metavar="DIR",
        parse=lambda _, text: Path(text),
        help="share compute with the engines started with the same directory: while k of them run a step, each gets "
        "--shared-cores / k of the compute, as vLLM servers on one CPU",
    )
    shared_cores: float = setting(
        1.0,
        flag="--shared-cores",
        parse=of_type(float),
        help="the cores --shared-compute's engines share (the default: vLLM's CPU binding puts every server on one)",
    )
    log: LogSettings = nested(LogSettings)

    @property
    def kv_transfer_address(self) -> str:
        """The host a prefill reply names for the decode engine's pull (``remote_host``)."""
        if self.kv_transfer_host:
            return self.kv_transfer_host
        return "localhost" if self.host in WILDCARD_HOSTS else self.host

    def __post_init__(self) -> None:
        if self.lora_modules and not self.enable_lora:  # as vLLM: adapters served need LoRA on
            object.__setattr__(self, "enable_lora", True)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be within 0..65535, got {self.port}")
        if self.events_endpoint == AUTO:  # bound, whatever its host: vLLM's rule is for given endpoints
            object.__setattr__(self, "events_endpoint", default_events_endpoint(self.port, self.host))
            object.__setattr__(self, "events_bind", True)
        if self.num_blocks < 2:
            raise ValueError(f"--num-blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")
        if self.block_size < 1 or self.max_model_len < 1 or self.buffer_steps < 1:
            raise ValueError("--block-size, --max-model-len and --buffer-steps must be positive")
        if self.metrics not in METRICS_MODES:
            raise ValueError(f"--metrics must be one of {', '.join(METRICS_MODES)}, got {self.metrics!r}")
        if self.engine_kind not in ENGINE_KINDS:
            raise ValueError(f"--engine-kind must be one of {', '.join(ENGINE_KINDS)}, got {self.engine_kind!r}")
        if self.engine_kind != "vllm" and (self.sliding_window or self.kv_transfer):
            raise ValueError("--sliding-window and --kv-transfer need --engine-kind vllm")
        if self.engine_kind == "trtllm" and (self.cpu_blocks or self.disk_blocks):
            raise ValueError("--cpu-blocks and --disk-blocks need --engine-kind vllm or sglang")
        if self.drop_events_every < 0:
            raise ValueError(f"--drop-events-every must be >= 0 (0: drop none), got {self.drop_events_every}")
        if not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer {self.tokenizer} has no tokenizer.json")
        for name, endpoint in (
            ("--events-endpoint", self.events_endpoint),
            ("--replay-endpoint", self.replay_endpoint),
        ):
            if endpoint is not None and "://" not in endpoint:
                raise ValueError(f"{name} must be a ZMQ endpoint like tcp://*:5557, got {endpoint!r}")
        if self.replay_endpoint is not None and self.events_endpoint is None:
            raise ValueError("--replay-endpoint needs KV events: drop --events-endpoint none")
        if self.shared_cores <= 0:
            raise ValueError(f"--shared-cores must be > 0, got {self.shared_cores:g}")
        if self.sliding_window < 0:
            raise ValueError(f"--sliding-window must be >= 0 (0: no sliding-window group), got {self.sliding_window}")
        self._check_tiers()
        self._check_kv_transfer()
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) < len(names) or self.model in names:
            raise ValueError("--lora-modules names must differ from each other and from --model")

    def _check_tiers(self) -> None:
        """The CPU and disk tiers: sizes and load times, and the settings they cannot go with."""
        for tier, flag, blocks, load_ms in (
            ("CPU", "cpu", self.cpu_blocks, self.cpu_load_ms_per_1k_tokens),
            ("disk", "disk", self.disk_blocks, self.disk_load_ms_per_1k_tokens),
        ):
            if blocks < 0 or load_ms < 0:
                raise ValueError(f"--{flag}-blocks and --{flag}-load-ms-per-1k-tokens must be >= 0")
            if self.sliding_window and blocks:
                raise ValueError(
                    f"--sliding-window and --{flag}-blocks cannot be combined: the {tier} tier is simulated for "
                    "full attention only; drop one of them"
                )
        if self.kv_transfer and self.disk_blocks:  # as with --cpu-blocks (_check_kv_transfer)
            raise ValueError("--kv-transfer cannot be combined with --disk-blocks: drop one of them")

    def _check_kv_transfer(self) -> None:
        if not 0 <= self.kv_transfer_ms_per_1k_tokens < float("inf"):
            raise ValueError(f"--kv-transfer-ms-per-1k-tokens must be >= 0, got {self.kv_transfer_ms_per_1k_tokens}")
        if not 0 < self.kv_transfer_timeout_s < float("inf"):
            raise ValueError(f"--kv-transfer-timeout-s must be > 0, got {self.kv_transfer_timeout_s}")
        if self.kv_transfer and (self.cpu_blocks or self.sliding_window):
            raise ValueError(
                "--kv-transfer cannot be combined with --cpu-blocks or --sliding-window: the transfer is "
                "simulated for one full-attention group without a CPU tier; drop one of them"
            )


def _events_endpoint(text: str) -> str | None:
    """--events-endpoint's text: none (no events), auto (the default's rule) or an endpoint."""
    word = text.strip()
    return None if word.lower() == "none" else AUTO if word.lower() == AUTO else word


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``kvroute sim-engine``, from :class:`SimEngineSettings`' declarations."""
    add_declared(parser, SimEngineSettings)


def settings_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> SimEngineSettings:
    """The flags, else the KVROUTE_SIM_* variables (KVROUTE_LOG_* for logging), else the defaults."""
    return read_declared(SimEngineSettings, args, os.environ if env is None else env)
