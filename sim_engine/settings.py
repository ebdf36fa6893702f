"""The simulated engine's settings: a frozen dataclass built from ``kvroute sim-engine`` flags."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvservice.logs import add_log_arguments
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
SLIDING_WINDOW_ENV = "KVROUTE_SIM_SLIDING_WINDOW"  # --sliding-window's default
DISK_BLOCKS_ENV = "KVROUTE_SIM_DISK_BLOCKS"  # --disk-blocks' default
DISK_LOAD_MS_ENV = "KVROUTE_SIM_DISK_LOAD_MS_PER_1K_TOKENS"  # --disk-load-ms-per-1k-tokens'
# --kv-transfer and its settings' defaults
KV_TRANSFER_ENV = "KVROUTE_SIM_KV_TRANSFER"
KV_TRANSFER_MS_ENV = "KVROUTE_SIM_KV_TRANSFER_MS_PER_1K_TOKENS"
KV_TRANSFER_TIMEOUT_ENV = "KVROUTE_SIM_KV_TRANSFER_TIMEOUT_S"
KV_TRANSFER_HOST_ENV = "KVROUTE_SIM_KV_TRANSFER_HOST"
SHARED_COMPUTE_ENV = "KVROUTE_SIM_SHARED_COMPUTE"  # --shared-compute's default
SWITCH_VALUES = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(("0", "false", "no", "off"), False)
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
    host: str = "127.0.0.1"
    port: int = 8000
    events_endpoint: str | None = AUTO  # AUTO becomes default_events_endpoint(port, host); None: no events
    events_bind: bool = False  # bind events_endpoint whatever it names (the default's); else vLLM's rule
    replay_endpoint: str | None = None
    topic: str = ""
    model: str = "tiny"
    tokenizer: Path = TINY_MODEL_DIR
    num_blocks: int = 2048
    block_size: int = 16
    max_model_len: int = 4096
    dp_rank: int = 0
    buffer_steps: int = 10_000
    drop_events_every: int = 0  # fault injection: every Nth KV-event batch is not sent
    timing: TimingModel = field(default_factory=TimingModel)
    # "full": vLLM's whole metric set on /metrics; "minimal": only the running, waiting and
    # KV-usage gauges (an engine, or an older vLLM, that reports little). /debug/metrics is full.
    metrics: str = "full"
    # "vllm", or "sglang": SGLang's KV-event wire (kvevents/sglang.py: a block is a page of
    # --block-size tokens), its /metrics names and owned_by in /v1/models
    engine_kind: str = "vllm"
    # LoRA adapters served from the start (NAME, PATH), and whether they may be loaded and
    # unloaded at run time (vLLM's --enable-lora with VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_lora: bool = False
    # A CPU tier behind the GPU cache (vLLM's native CPU offloading): its size in blocks (0: none)
    # and its load time (sim_engine/offload.py).
    cpu_blocks: int = 0
    cpu_load_ms_per_1k_tokens: float = 4.0
    # A disk tier behind it (LMCache's local-disk backend; without a CPU tier: right behind the
    # GPU cache): its size in blocks (0: none) and its load time (sim_engine/offload.py).
    disk_blocks: int = 0
    disk_load_ms_per_1k_tokens: float = 30.0
    # A hybrid model's KV cache (sim_engine/hybrid.py): a sliding-window group of this many tokens
    # beside the full-attention one, as vLLM keeps for layer_types [sliding_attention,
    # full_attention]; 0: one full-attention group.
    sliding_window: int = 0
    # Prefill/decode disaggregation (sim_engine/kv_transfer.py): every engine can serve either leg,
    # as vLLM's NIXL connector with kv_role kv_both; a pull takes this long per 1k tokens; a
    # finished prefill keeps its blocks this long unless a decode engine holding a request for
    # them renews the lease (vLLM's kv_lease_duration); the host its replies name for pulls
    # (None: --host, or localhost when that is a wildcard).
    kv_transfer: bool = False
    kv_transfer_ms_per_1k_tokens: float = DEFAULT_MS_PER_1K_TOKENS
    kv_transfer_timeout_s: float = DEFAULT_TIMEOUT_S
    kv_transfer_host: str | None = None
    # Engines that share their compute (sim_engine/shared_compute.py): those started with the same
    # directory share this many cores, as vLLM servers on one CPU do; None: a step's time alone.
    shared_compute: Path | None = None
    shared_cores: float = 1.0

    @property
    def kv_transfer_address(self) -> str:
        """The host a prefill reply names for the decode engine's pull (``remote_host``)."""
        if self.kv_transfer_host:
            return self.kv_transfer_host
        return "localhost" if self.host in WILDCARD_HOSTS else self.host

    def __post_init__(self) -> None:
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


def switch(value: object, name: str) -> bool:
    """A switch given as a flag (a bool) or by its environment variable ``name`` (1/0, true/false, ...)."""
    if isinstance(value, bool):
        return value
    parsed = SWITCH_VALUES.get(str(value).strip().lower())
    if parsed is None:
        raise ValueError(f"{name} must be one of {', '.join(SWITCH_VALUES)}, got {value!r}")
    return parsed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimEngineSettings()
    parser.add_argument("--host", default=d.host, help=f"HTTP address (default {d.host})")
    parser.add_argument("--port", type=int, default=d.port, help=f"HTTP port (default {d.port}; 0 picks a free one)")
    parser.add_argument(
        "--events-endpoint",
        default=AUTO,
        help="ZMQ PUB endpoint for KV events; bound when it is a wildcard like tcp://*:5557, connected otherwise "
        f"(as vLLM); 'none' turns events off; default auto: bound on --host, tcp://<host>:<--port - "
        f"{EVENTS_PORT_OFFSET}> (tcp://127.0.0.1:5557 for port 8000, a free port for --port 0; tcp://*:... for "
        "--host 0.0.0.0)",
    )
    parser.add_argument("--replay-endpoint", default=None, help="ZMQ ROUTER endpoint for replay (default off)")
    parser.add_argument("--topic", default=d.topic, help='KV-event topic (default "")')
    parser.add_argument("--model", default=d.model, help=f"served model name (default {d.model})")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=d.tokenizer,
        help="model dir with tokenizer.json and a chat template (default: the tiny model)",
    )
    parser.add_argument("--num-blocks", type=int, default=d.num_blocks, help=f"KV blocks (default {d.num_blocks})")
    parser.add_argument(
        "--block-size", type=int, default=d.block_size, help=f"tokens per block (default {d.block_size})"
    )
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len, help=f"default {d.max_model_len}")
    parser.add_argument("--dp-rank", type=int, default=0, help="data-parallel rank reported in events and metrics")
    parser.add_argument("--buffer-steps", type=int, default=d.buffer_steps, help="batches kept for replay")
    parser.add_argument(
        "--drop-events-every",
        type=int,
        default=0,
        help="fault injection: every Nth KV-event batch is kept for replay but not sent, so subscribers see "
        "sequence gaps (default 0: send all)",
    )
    parser.add_argument(
        "--metrics",
        choices=METRICS_MODES,
        default=d.metrics,
        help="what /metrics exports: full (vLLM's names, default) or minimal (only vllm:num_requests_running, "
        "vllm:num_requests_waiting and vllm:kv_cache_usage_perc, as an engine that reports little); "
        "/debug/metrics always has the full set",
    )
    parser.add_argument(
        "--engine-kind",
        choices=ENGINE_KINDS,
        default=d.engine_kind,
        help="the engine imitated: its KV-event wire, /metrics names and /v1/models owned_by (default vllm; "
        "sglang: a block is a page of --block-size tokens; trtllm: events on POST /kv_cache_events, JSON "
        "iteration stats on /metrics)",
    )
    _add_timing_arguments(parser, d.timing)
    _add_kv_transfer_arguments(parser)
    add_log_arguments(parser)


def _add_kv_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-transfer",
        action="store_true",
        # a string default is checked by settings_from_args: a malformed variable is a one-line error
        default=os.environ.get(KV_TRANSFER_ENV, "0"),
        help="prefill/decode disaggregation as vLLM's NIXL connector (kv_both): a request's kv_transfer_params "
        "make it a prefill leg that keeps its KV for a decode engine, or a decode leg that pulls it from one "
        f"(default off: kv_transfer_params are ignored; env {KV_TRANSFER_ENV})",
    )
    parser.add_argument(
        "--kv-transfer-ms-per-1k-tokens",
        type=float,
        default=os.environ.get(KV_TRANSFER_MS_ENV, str(DEFAULT_MS_PER_1K_TOKENS)),
        metavar="MS",
        help="a decode leg's pull of its prompt's KV takes this long per 1k tokens pulled, divided by --speedup "
        f"(default {DEFAULT_MS_PER_1K_TOKENS:g}: an 8B model's KV over RDMA; env {KV_TRANSFER_MS_ENV})",
    )
    parser.add_argument(
        "--kv-transfer-timeout-s",
        type=float,
        default=os.environ.get(KV_TRANSFER_TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S)),
        metavar="S",
        help="a finished prefill leg keeps its blocks this long (wall clock) for a decode engine, renewed while "
        f"a decode engine holds a request for them (vLLM's kv_lease_duration; default {DEFAULT_TIMEOUT_S:g}; "
        f"env {KV_TRANSFER_TIMEOUT_ENV})",
    )
    parser.add_argument(
        "--kv-transfer-host",
        default=os.environ.get(KV_TRANSFER_HOST_ENV),
        metavar="HOST",
        help="the host a prefill reply names for the decode engine's pull (remote_host; the port is --port's) "
        f"(default --host, or localhost when it is a wildcard; env {KV_TRANSFER_HOST_ENV})",
    )


def _add_timing_arguments(parser: argparse.ArgumentParser, t: TimingModel) -> None:
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=t.max_num_batched_tokens,
        help="tokens one engine step may schedule, shared by decodes and prefill chunks (chunked prefill, as "
        f"vLLM; default {t.max_num_batched_tokens}, vLLM's default for an online server; 0: no budget)",
    )
    parser.add_argument(
        "--max-num-seqs",
        "--max-running",
        dest="max_num_seqs",
        type=int,
        default=t.max_num_seqs,
        help=f"batch limit: requests running at once, more wait (default {t.max_num_seqs}; --max-running: the same)",
    )
    parser.add_argument(
        "--prefill-ms-per-1k-tokens",
        type=float,
        default=t.prefill_ms_per_1k_tokens,
        help=f"prefill ms per 1k uncached tokens (default {t.prefill_ms_per_1k_tokens})",
    )
    parser.add_argument(
        "--decode-ms-per-step",
        type=float,
        default=t.decode_ms_per_step,
        help=f"time of a step that decodes (default {t.decode_ms_per_step})",
    )
    parser.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=t.decode_ms_per_token,
        help=f"added per decoding request in a step: large batches decode slower (default {t.decode_ms_per_token})",
    )
    parser.add_argument(
        "--step-overhead-ms",
        type=float,
        default=t.step_overhead_ms,
        help=f"fixed time per step (default {t.step_overhead_ms})",
    )
    parser.add_argument(
        "--prefill-context-ns",
        type=float,
        default=t.prefill_context_ns,
        help="attention's share of prefill: a chunk of N new tokens after P computed ones takes this many ns "
        "x N x (P + N/2) more (default 0; an H200 with Llama-3.1-8B in bf16 measured 2.0 beside 18.5 us per token)",
    )
    parser.add_argument(
        "--parallel-prefill",
        action="store_true",
        help="each request's prefill in its own lane: the token budget is per request and a step takes its "
        "longest chunk's time, not their sum (an engine whose prefills do not queue behind each other)",
    )
    parser.add_argument("--speedup", type=float, default=t.speedup, help="run this many times faster than real time")
    parser.add_argument(
        "--shared-compute",
        type=Path,
        default=os.environ.get(SHARED_COMPUTE_ENV) or None,
        metavar="DIR",
        help="share compute with the engines started with the same directory: while k of them run a step, "
        f"each gets --shared-cores / k of the compute, as vLLM servers on one CPU (default: none; env "
        f"{SHARED_COMPUTE_ENV})",
    )
    parser.add_argument(
        "--shared-cores",
        type=float,
        default=SimEngineSettings.shared_cores,
        help="the cores --shared-compute's engines share (default 1: vLLM's CPU binding puts every server on one)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served from the start, as vLLM's flag (requests name them as the model)",
    )
    parser.add_argument(
        "--cpu-blocks",
        type=int,
        default=SimEngineSettings.cpu_blocks,
        help="a CPU tier of this many blocks behind the GPU cache, as vLLM's CPU offloading (default 0: none)",
    )
    parser.add_argument(
        "--cpu-load-ms-per-1k-tokens",
        type=float,
        default=SimEngineSettings.cpu_load_ms_per_1k_tokens,
        help="the CPU tier's load time per 1k tokens (default 4: an 8B model's KV over PCIe Gen5)",
    )
    parser.add_argument(
        "--disk-blocks",
        type=int,
        default=os.environ.get(DISK_BLOCKS_ENV, str(SimEngineSettings.disk_blocks)),
        help="a disk tier of this many blocks behind the CPU tier (or the GPU cache without one), as LMCache's "
        f"local-disk backend (default 0: none; env {DISK_BLOCKS_ENV})",
    )
    parser.add_argument(
        "--disk-load-ms-per-1k-tokens",
        type=float,
        default=os.environ.get(DISK_LOAD_MS_ENV, f"{SimEngineSettings.disk_load_ms_per_1k_tokens:g}"),
        help="the disk tier's load time per 1k tokens (default 30: an 8B model's KV from a local NVMe drive; "
        f"env {DISK_LOAD_MS_ENV})",
    )
    parser.add_argument(
        "--sliding-window",
        type=int,
        # a string default goes through type=int: a malformed variable is argparse's error
        default=os.environ.get(SLIDING_WINDOW_ENV, "0"),
        metavar="TOKENS",
        help="a hybrid model's KV cache: a sliding-window group of this many tokens beside the "
        "full-attention one, sharing the blocks, as vLLM runs layer_types [sliding_attention, "
        f"full_attention] (default 0: full attention only; env {SLIDING_WINDOW_ENV})",
    )
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="also load and unload adapters at run time (/v1/load_lora_adapter, /v1/unload_lora_adapter)",
    )


def settings_from_args(args: argparse.Namespace) -> SimEngineSettings:
    timing = TimingModel(
        prefill_ms_per_1k_tokens=args.prefill_ms_per_1k_tokens,
        decode_ms_per_step=args.decode_ms_per_step,
        step_overhead_ms=args.step_overhead_ms,
        max_num_seqs=args.max_num_seqs,
        speedup=args.speedup,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_ms_per_token=args.decode_ms_per_token,
        prefill_context_ns=args.prefill_context_ns,
        parallel_prefill=args.parallel_prefill,
    )
    events = None if str(args.events_endpoint).lower() == "none" else str(args.events_endpoint).strip()
    return SimEngineSettings(
        host=args.host,
        port=args.port,
        events_endpoint=AUTO if events is not None and events.lower() == AUTO else events,
        replay_endpoint=args.replay_endpoint,
        topic=args.topic,
        model=args.model,
        tokenizer=args.tokenizer,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        dp_rank=args.dp_rank,
        buffer_steps=args.buffer_steps,
        drop_events_every=args.drop_events_every,
        timing=timing,
        metrics=args.metrics,
        engine_kind=args.engine_kind,
        lora_modules=tuple(parse_module(text) for text in args.lora_modules),
        enable_lora=args.enable_lora or bool(args.lora_modules),
        cpu_blocks=args.cpu_blocks,
        cpu_load_ms_per_1k_tokens=args.cpu_load_ms_per_1k_tokens,
        disk_blocks=args.disk_blocks,
        disk_load_ms_per_1k_tokens=args.disk_load_ms_per_1k_tokens,
        sliding_window=args.sliding_window,
        kv_transfer=switch(args.kv_transfer, KV_TRANSFER_ENV),
        kv_transfer_ms_per_1k_tokens=args.kv_transfer_ms_per_1k_tokens,
        kv_transfer_timeout_s=args.kv_transfer_timeout_s,
        kv_transfer_host=args.kv_transfer_host,
        shared_compute=args.shared_compute,
        shared_cores=args.shared_cores,
    )
