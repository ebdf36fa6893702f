"""``kvroute bench ...``: benchmarks whose figures go into docs/benchmarks.md."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(commands: Any) -> None:
    bench = commands.add_parser("bench", help="run a benchmark")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    p = sub.add_parser("index", help="match latency, Redis CPU per match, ingest rate and memory of the index")
    p.add_argument("--redis-url", help="use this Redis server (default: start a private one)")
    p.add_argument("--entries", type=int, default=1_000_000, help="(block, worker) entries to load per worker count")
    p.add_argument("--prompt-blocks", default="64,512,2048", help="comma-separated prompt lengths in blocks")
    p.add_argument("--workers", default="8,64,128", help="comma-separated worker counts")
    p.add_argument("--queries", type=int, default=2000, help="matches timed per cell")
    p.add_argument("--writers", type=int, default=8, help="concurrent writers for the ingest test")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.set_defaults(handler=_run_index)

    p = sub.add_parser("agent", help="block events per second one agent process applies")
    p.add_argument("--redis-url", help="use this Redis server (default: start a private one)")
    p.add_argument("--batches", type=int, default=20_000, help="engine batches to publish")
    p.add_argument("--blocks-per-batch", type=int, default=8, help="blocks stored (and, once full, evicted) per batch")
    p.add_argument("--cache-blocks", type=int, default=20_000, help="the simulated engine's cache size in blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.set_defaults(handler=_run_agent)

    p = sub.add_parser("sim", help="memory, idle CPU and throughput of N simulated engines")
    p.add_argument("--engines", type=int, default=16, help="simulated engine processes")
    p.add_argument("--idle-seconds", type=float, default=10.0, help="how long idle CPU is measured")
    p.add_argument("--load-seconds", type=float, default=10.0, help="how long the load runs")
    p.add_argument("--concurrency", type=int, default=32, help="concurrent clients during the load")
    p.add_argument("--speedup", type=float, default=20.0, help="the engines' --speedup")
    p.set_defaults(handler=_run_sim)

    p = sub.add_parser("router", help="latency the router adds, and requests/s of one router process")
    p.add_argument("--rate", type=float, default=200.0, help="open-loop requests/s for the latency runs")
    p.add_argument("--requests", type=int, default=1000, help="requests per latency run")
    p.add_argument("--seconds", type=float, default=10.0, help="duration of the max-throughput run")
    p.add_argument("--concurrency", type=int, default=64, help="clients in the max-throughput run")
    p.add_argument("--sglang", action="store_true", help="also measure the SGLang router (pip install sglang-router)")
    p.set_defaults(handler=_run_router)

    p = sub.add_parser("replay", help="routing quality on a Mooncake-format trace, policies side by side")
    p.add_argument("trace", nargs="?", help="a Mooncake-format trace (JSON lines: timestamp, input_length, hash_ids)")
    p.add_argument("--synthetic", choices=["shared-prefix", "multi-turn", "documents"],
                   help="a built-in workload instead of a trace")  # fmt: skip
    p.add_argument("--limit", type=int, default=1000, help="replay the first N requests (default 1000)")
    p.add_argument("--max-input", type=int, default=32_768, help="skip requests longer than this (tokens)")
    p.add_argument("--max-output", type=int, default=8, help="cap output tokens (default 8)")
    p.add_argument("--engines", type=int, default=8, help="simulated engines (default 8)")
    p.add_argument("--cache-fraction", type=float, default=0.1, help="fleet cache / distinct blocks (default 0.1)")
    p.add_argument("--block-size", type=int, default=16, help="engine block size (default 16)")
    p.add_argument("--time-scale", type=float, default=20.0, help="replay this many times faster (default 20)")
    p.add_argument("--prefill-ms-per-1k", type=float, default=50.0, help="engines' prefill cost (default 50)")
    p.add_argument("--max-running", type=int, default=32, help="engines' batch limit (default 32)")
    p.add_argument("--policies", default="kv,round_robin", help="comma-separated policies")
    p.add_argument("--replicas", default="1,4", help="comma-separated router replica counts")
    p.add_argument(
        "--peer",
        choices=["sglang"],
        help="also run the SGLang router (cache_aware) on the same engines; "
        "sends text prompts to every router (sglang-router from $KVROUTE_SGLANG_PYTHON or python3)",
    )
    p.add_argument(
        "--prompts",
        choices=["tokens", "text"],
        default="tokens",
        help="send token ids (default) or text (one word per token)",
    )
    p.add_argument(
        "--concurrency", type=int, default=0, help="send at this fixed concurrency instead of at the trace's timestamps"
    )
    p.add_argument(
        "--router-url",
        help="replay through running routers (comma-separated replica URLs) instead of "
        "a self-started stack; the LRU reference then assumes --cache-fraction",
    )
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--chart", default="kvroute-replay.png", help="where to write the PNG chart")
    p.set_defaults(handler=_run_replay)


def _run_index(args: argparse.Namespace) -> int:
    from kvroute.bench_index import run_from_args

    return run_from_args(args)


def _run_agent(args: argparse.Namespace) -> int:
    from kvroute.bench_agent import run_from_args

    return run_from_args(args)


def _run_sim(args: argparse.Namespace) -> int:
    from kvroute.bench_sim import run_from_args

    return run_from_args(args)


def _run_router(args: argparse.Namespace) -> int:
    from kvroute.bench_router import run_from_args

    return run_from_args(args)


def _run_replay(args: argparse.Namespace) -> int:
    from kvroute.bench_replay import run_from_args
    from kvroute.peers import PeerError

    if (args.trace is None) == (args.synthetic is None):
        raise SystemExit("kvroute bench replay: give a TRACE file or --synthetic KIND (one of them)")
    if args.concurrency < 0 or args.limit <= 0 or args.time_scale <= 0 or not 0 < args.cache_fraction <= 1:
        raise SystemExit("kvroute bench replay: --concurrency >= 0, --limit > 0, --time-scale > 0 and "
                         "0 < --cache-fraction <= 1 are required")  # fmt: skip
    if args.router_url and args.peer:
        raise SystemExit("kvroute bench replay: --peer needs the self-started stack, not --router-url")
    try:
        return run_from_args(args)
    except (ValueError, OSError, PeerError) as exc:  # a malformed or missing trace, a peer that would not start
        raise SystemExit(f"kvroute bench replay: {exc}") from None
