"""The simulated engine's settings: a frozen dataclass built from ``kvroute sim-engine`` flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from kvservice.logs import add_log_arguments
from sim_engine.engine import TimingModel

# The tokenizer and chat template of the shared tiny model (no weights): text prompts tokenize
# exactly as the real vLLM server of ../shared/fixtures/vllm-0.32-cpu does.
TINY_MODEL_DIR = Path(__file__).resolve().parent / "tiny_model"


@dataclass(frozen=True)
class SimEngineSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    events_endpoint: str | None = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    model: str = "tiny"
    tokenizer: Path = TINY_MODEL_DIR
    num_blocks: int = 2048
    block_size: int = 16
    max_model_len: int = 4096
    dp_rank: int = 0
    buffer_steps: int = 10_000
    timing: TimingModel = field(default_factory=TimingModel)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be within 0..65535, got {self.port}")
        if self.num_blocks < 2:
            raise ValueError(f"--num-blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")
        if self.block_size < 1 or self.max_model_len < 1 or self.buffer_steps < 1:
            raise ValueError("--block-size, --max-model-len and --buffer-steps must be positive")
        if not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer {self.tokenizer} has no tokenizer.json")
        for name, endpoint in (
            ("--events-endpoint", self.events_endpoint),
            ("--replay-endpoint", self.replay_endpoint),
        ):
            if endpoint is not None and "://" not in endpoint:
                raise ValueError(f"{name} must be a ZMQ endpoint like tcp://*:5557, got {endpoint!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimEngineSettings()
    t = d.timing
    parser.add_argument("--host", default=d.host, help=f"HTTP address (default {d.host})")
    parser.add_argument("--port", type=int, default=d.port, help=f"HTTP port (default {d.port}; 0 picks a free one)")
    parser.add_argument("--events-endpoint", default=d.events_endpoint,
                        help="ZMQ PUB endpoint for KV events; bound when it is a wildcard like tcp://*:5557, "
                        "connected otherwise (as vLLM); 'none' turns events off")  # fmt: skip
    parser.add_argument("--replay-endpoint", default=None, help="ZMQ ROUTER endpoint for replay (default off)")
    parser.add_argument("--topic", default=d.topic, help='KV-event topic (default "")')
    parser.add_argument("--model", default=d.model, help=f"served model name (default {d.model})")
    parser.add_argument("--tokenizer", type=Path, default=d.tokenizer,
                        help="model dir with tokenizer.json and a chat template (default: the tiny model)")  # fmt: skip
    parser.add_argument("--num-blocks", type=int, default=d.num_blocks, help=f"KV blocks (default {d.num_blocks})")
    parser.add_argument(
        "--block-size", type=int, default=d.block_size, help=f"tokens per block (default {d.block_size})"
    )
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len, help=f"default {d.max_model_len}")
    parser.add_argument("--dp-rank", type=int, default=0, help="data-parallel rank reported in events and metrics")
    parser.add_argument("--buffer-steps", type=int, default=d.buffer_steps, help="batches kept for replay")
    parser.add_argument("--max-running", type=int, default=t.max_running, help=f"batch limit (default {t.max_running})")
    parser.add_argument("--prefill-ms-per-1k-tokens", type=float, default=t.prefill_ms_per_1k_tokens,
                        help=f"prefill ms per 1k uncached tokens (default {t.prefill_ms_per_1k_tokens})")  # fmt: skip
    parser.add_argument("--decode-ms-per-step", type=float, default=t.decode_ms_per_step,
                        help=f"time of a step that decodes (default {t.decode_ms_per_step})")  # fmt: skip
    parser.add_argument("--step-overhead-ms", type=float, default=t.step_overhead_ms,
                        help=f"fixed time per step (default {t.step_overhead_ms})")  # fmt: skip
    parser.add_argument("--speedup", type=float, default=t.speedup, help="run this many times faster than real time")
    add_log_arguments(parser)


def settings_from_args(args: argparse.Namespace) -> SimEngineSettings:
    timing = TimingModel(args.prefill_ms_per_1k_tokens, args.decode_ms_per_step, args.step_overhead_ms,
                         args.max_running, args.speedup)  # fmt: skip
    events = None if str(args.events_endpoint).lower() == "none" else args.events_endpoint
    return SimEngineSettings(args.host, args.port, events, args.replay_endpoint, args.topic, args.model,
                             args.tokenizer, args.num_blocks, args.block_size, args.max_model_len, args.dp_rank,
                             args.buffer_steps, timing)  # fmt: skip
