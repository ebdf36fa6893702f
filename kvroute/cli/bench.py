"""``kvroute bench ...``: benchmarks whose figures go into docs/benchmarks.md.

The flags of each benchmark; the work is in :mod:`kvroute.bench`'s module of the same name, imported
only when that benchmark runs. A process a benchmark started that exits or never comes up ends the
run with one message (exit status 1); bad settings are a ``StartupError`` (exit status 2).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from kvindex.settings import add_redis_security_arguments, export_redis_security_arguments
from kvroute.cli.argtypes import non_negative_float, positive_float, positive_int, positive_ints

PROBE_HELP = (
    "before each request, ask every engine what it holds of the prompt, and split each run's hit rate into "
    "the best any engine held at the send, what the choice gave up and what was evicted before the prompt "
    "was scheduled (a few ms per request; docs/benchmarks.md)"
)


def add_parser(commands: Any) -> None:
    bench = commands.add_parser("bench", help="run a benchmark")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)

    def benchmark(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(handler=_run, prog=p.prog)
        return p

    _index_flags(benchmark("index", "match latency, Redis CPU per match, ingest rate and memory of the index"))
    _agent_flags(benchmark("agent", "block events per second one agent process applies"))
    _sim_flags(benchmark("sim", "memory, idle CPU and throughput of N simulated engines"))
    _router_flags(benchmark("router", "latency the router adds, and requests/s of one router process"))
    _replay_flags(benchmark("replay", "routing quality on a Mooncake-format trace, policies side by side"))
    _regimes_flags(benchmark("regimes", "every policy on a grid of regimes, each against the best in its cell"))
    _real_flags(benchmark("real", "the policies on real vLLM engines (or the simulated engine, checked against them)"))
    _soak_flags(benchmark("soak", "the whole stack under a steady chat load for N minutes, memory sampled"))
    _hybrid_flags(benchmark("hybrid", "what a hybrid model's decision reads beside the match (its window blocks)"))
    _path_flags(benchmark("path", "the router's files one completion passes through, and its returns to them"))
    _epp_flags(benchmark("epp", "how fast one kvroute epp process picks: ext_proc round latency and picks/s"))


def _epp_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kinds", type=lambda t: t.split(","), default=["ids8k", "text2k"], help="ids8k,text2k (both)")
    p.add_argument("--requests", type=positive_int, default=300, help="rounds timed per kind, one at a time (300)")
    p.add_argument("--concurrency", type=positive_int, default=16, help="streams at once for picks/s (16)")
    p.add_argument("--seconds", type=positive_int, default=5, help="how long picks/s is measured (5)")


def _path_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-tokens", type=positive_int, default=2048, help="the prompt's length in token ids (2048)")
    p.add_argument("--warmup", type=positive_int, default=5, help="requests sent first, not counted (5)")
    p.add_argument("--runs", type=positive_int, default=5, help="completions counted, one line each (5)")
    p.add_argument("--trail", action="store_true", help="print each run's files in the order entered")


def _hybrid_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", help="use this Redis server (default: start a private one)")
    p.add_argument("--workers", type=positive_int, default=8, help="workers holding the prompt (8)")
    p.add_argument("--prompt-tokens", type=positive_int, default=2048, help="the prompt's length (2048)")
    p.add_argument("--window", type=positive_int, default=1024, help="the sliding window in tokens (1024)")
    p.add_argument("--queries", type=positive_int, default=500, help="decisions timed each way (500)")


def _index_flags(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--redis-url", help="use this Redis server, or a redis+cluster:// cluster (default: start a private one)"
    )
    where.add_argument(
        "--cluster", action="store_true", help="start a private Redis Cluster (3 masters, a replica each) and use it"
    )
    add_redis_security_arguments(p)
    p.add_argument(
        "--entries", type=positive_int, default=1_000_000, help="(block, worker) entries to load per worker count"
    )
    p.add_argument(
        "--prompt-blocks", type=positive_ints, default="64,512,2048", help="comma-separated prompt lengths in blocks"
    )
    p.add_argument("--workers", type=positive_ints, default="8,64,128", help="comma-separated worker counts")
    p.add_argument("--queries", type=positive_int, default=2000, help="matches timed per cell")
    p.add_argument("--writers", type=positive_int, default=8, help="concurrent writers for the ingest test")
    p.add_argument(
        "--roots", type=positive_int, default=1024, help="cluster: distinct system prompts (chain roots) of the fleet"
    )
    p.add_argument(
        "--trace",
        help="instead: Redis CPU per request of this Mooncake-format trace (routed and cached through the index)",
    )
    p.add_argument("--trace-requests", type=positive_int, default=2000, help="--trace: requests to replay")
    p.add_argument("--trace-workers", type=positive_int, default=16, help="--trace: workers of the fleet")
    p.add_argument(
        "--trace-capacity", type=positive_int, default=20_000, help="--trace: each worker's cache size in blocks"
    )
    p.add_argument(
        "--shared-blocks",
        type=positive_int,
        default=32,
        help="cluster: blocks of each system prompt, the start every chain under it shares (default 32)",
    )
    p.add_argument(
        "--concurrency", type=positive_int, default=32, help="cluster: concurrent clients in the matches/s runs"
    )
    p.add_argument(
        "--seconds", type=positive_float, default=10.0, help="cluster: duration of each matches/s run (default 10)"
    )
    p.add_argument("--json", help="also write the results to this JSON file")


def _agent_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", help="use this Redis server (default: start a private one)")
    add_redis_security_arguments(p)
    p.add_argument("--batches", type=positive_int, default=20_000, help="engine batches to publish")
    p.add_argument(
        "--blocks-per-batch", type=positive_int, default=8, help="blocks stored (and, once full, evicted) per batch"
    )
    p.add_argument(
        "--cache-blocks", type=positive_int, default=20_000, help="the simulated engine's cache size in blocks"
    )
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per block")
    p.add_argument(
        "--sglang-page-size",
        type=positive_int,
        default=None,
        help="play an SGLang engine with pages of this many tokens (its wire; the agent re-blocks the pages into "
        "--block-size blocks); default: a vLLM engine",
    )


def _sim_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=positive_int, default=16, help="simulated engine processes")
    p.add_argument("--idle-seconds", type=positive_float, default=10.0, help="how long idle CPU is measured")
    p.add_argument("--load-seconds", type=positive_float, default=10.0, help="how long the load runs")
    p.add_argument("--concurrency", type=positive_int, default=32, help="concurrent clients during the load")
    p.add_argument("--speedup", type=positive_float, default=20.0, help="the engines' --speedup")


# kvroute bench router's runs: latency of 8k token ids, 2k-word text, multi-turn chats and
# transcripts; the most requests/s.
ROUTER_KINDS = ("ids8k", "text2k", "chat", "turns", "max_rps")


def _router_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(ROUTER_KINDS))
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"runs must be some of {','.join(ROUTER_KINDS)}, got {text!r}")
    return tuple(k for k in ROUTER_KINDS if k in kinds)


def _router_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=positive_float, default=200.0, help="open-loop requests/s for the latency runs")
    p.add_argument("--requests", type=positive_int, default=1000, help="requests per latency run")
    p.add_argument("--seconds", type=positive_float, default=10.0, help="duration of the max-throughput run")
    p.add_argument("--concurrency", type=positive_int, default=64, help="clients in the max-throughput run")
    p.add_argument("--sglang", action="store_true", help="also measure the SGLang router (pip install sglang-router)")
    p.add_argument(
        "--kinds",
        type=_router_kinds,
        default=ROUTER_KINDS,
        help=f"comma-separated runs to make, of {','.join(ROUTER_KINDS)} (default: all); max_rps: the most "
        "requests/s, of one process and of --workers 2",
    )


def _replay_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="?", help="a Mooncake-format trace (JSON lines: timestamp, input_length, hash_ids)")
    p.add_argument(
        "--synthetic",
        choices=["shared-prefix", "multi-turn", "documents"],
        help="a built-in workload instead of a trace",
    )
    p.add_argument("--limit", type=positive_int, default=1000, help="replay the first N requests (default 1000)")
    p.add_argument("--max-input", type=positive_int, default=32_768, help="skip requests longer than this (tokens)")
    p.add_argument("--max-output", type=positive_int, default=8, help="cap output tokens (default 8)")
    p.add_argument("--engines", type=positive_int, default=8, help="simulated engines (default 8)")
    p.add_argument("--cache-fraction", type=float, default=0.1, help="fleet cache / distinct blocks (default 0.1)")
    p.add_argument("--block-size", type=positive_int, default=16, help="engine block size (default 16)")
    p.add_argument("--time-scale", type=positive_float, default=20.0, help="replay this many times faster (default 20)")
    p.add_argument("--prefill-ms-per-1k", type=float, default=50.0, help="engines' prefill cost (default 50)")
    p.add_argument("--max-running", type=positive_int, default=32, help="engines' batch limit (default 32)")
    p.add_argument(
        "--prefill-context-ns",
        type=float,
        default=0.0,
        help="engines' attention term: N new tokens after P computed take this many ns x N x (P + N/2) more "
        "(default 0; 5.4 keeps an H200's measured ratio at 50 ms per 1k tokens)",
    )
    p.add_argument("--policies", default="kv,round_robin", help="comma-separated policies")
    p.add_argument("--replicas", default="1,4", help="comma-separated router replica counts")
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="run every router and replica count this many times, in turn, and print each one's mean and "
        "range (one run of a trace can move by many points between sittings)",
    )
    p.add_argument(
        "--peer",
        help="also run these routers on the same engines (comma-separated): sglang, the SGLang router "
        "(cache_aware; text prompts to every router; sglang-router from $KVROUTE_SGLANG_PYTHON or python3); "
        "greedy_oracle, a reference that asks each engine what it holds now and takes the longest match",
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
    p.add_argument("--probe", action="store_true", help=PROBE_HELP + " (the self-started stack only)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--chart", default="kvroute-replay.png", help="where to write the PNG chart")


def _regimes_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--axis",
        action="append",
        metavar="NAME=V1,V2",
        help="the values of one axis (repeatable): tenants=balanced,hot,zipf,chat load=light,heavy,overload,closed "
        "cache=tight,loose,tiny,ample client=stream,nostream prompts=ids,text replicas=1,2,4 engine=full,minimal "
        "prefill=serial,parallel tiers=gpu,cpu,disk fleet=agg,pd; with --axis the grid is tenants x load at "
        "cache=tight client=stream prompts=ids replicas=1 engine=full prefill=serial tiers=gpu fleet=agg, each "
        "flag replacing one axis's values "
        "(default grid, without --axis: twelve cells at 1, 2 and 4 replicas, two of them closed-loop, "
        "docs/benchmarks.md)",
    )
    p.add_argument("--full", action="store_true", help="every value of every axis (2,592 cells: days)")
    p.add_argument(
        "--policies",
        default="kv,round_robin,least_loaded,prefix,greedy_oracle,sglang",
        help="comma-separated policies (greedy_oracle: the reference that asks each engine what it holds; "
        "sglang: text cells only, with $KVROUTE_SGLANG_PYTHON)",
    )
    p.add_argument("--seed", type=int, default=None, help="one workload seed (default: the seeds 1,2,3,4)")
    p.add_argument(
        "--seeds",
        metavar="S1,S2",
        help="workload seeds (default 1,2,3,4; overrides --seed): every cell runs once per seed and each "
        "policy is judged on the geometric mean of its ratios to the best over the seeds (one run of a "
        "tight cell can be off by 2x); the tables and the heat map give each figure's range over them",
    )
    p.add_argument("--requests-per-cell", type=positive_int, default=160, help="requests per run (default 160)")
    p.add_argument(
        "--wall-rate",
        type=positive_float,
        default=20.0,
        help="requests per wall second in every run; the engines' clock is sped up to match (default 20)",
    )
    p.add_argument("--engines", type=positive_int, default=4, help="simulated engines (default 4)")
    p.add_argument("--prefill-ms-per-1k", type=positive_float, default=50.0, help="engines' prefill cost (default 50)")
    p.add_argument(
        "--decode-ms-per-step", type=positive_float, default=10.0, help="engines' decode step time (default 10)"
    )
    p.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=2048, help="engines' tokens per step (default 2048)"
    )
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="engines' batch limit (default 64)")
    p.add_argument("--block-size", type=positive_int, default=16, help="engine block size (default 16)")
    p.add_argument(
        "--prefill-context-ns",
        type=float,
        default=0.0,
        help="engines' attention term: a chunk of N new tokens after P computed takes this many ns x N x "
        "(P + N/2) more (default 0; 5.4 scales an H200's measured 2.0 to these engines' 50 ms per 1k tokens)",
    )
    p.add_argument("--max-output", type=positive_int, default=8, help="cap output tokens (default 8)")
    p.add_argument("--probe", action="store_true", help=PROBE_HELP)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--chart", help="write a heat map PNG here")


def _names(text: str) -> list[str]:
    """Comma-separated names, e.g. 'ids,text' (each checked by the benchmark)."""
    names = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _cache_blocks(text: str) -> dict[str, int]:
    """NAME=BLOCKS pairs, e.g. 'tight=64,roomy=192'."""
    out = {}
    for pair in _names(text):
        name, sep, blocks = pair.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"expected NAME=BLOCKS pairs like tight=64,roomy=192, got {pair!r}")
        out[name.strip()] = positive_int(blocks.strip())
    return out


def _real_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine",
        choices=["vllm", "sim"],
        default="vllm",
        help="real vLLM servers (the CPU build of .ci/vllm-env, $KVROUTE_VLLM_VENV; default) or simulated engines "
        "of the same sizes and limits, timed as vLLM on this machine (to check the simulator: --compare)",
    )
    p.add_argument("--engines", type=positive_int, default=4, help="engines, an agent each (default 4)")
    p.add_argument(
        "--workloads", type=_names, default=["ids", "text", "chat"], help="of ids,text,chat (default: all three)"
    )
    p.add_argument("--caches", type=_names, default=["tight", "roomy"], help="cache sizes (default tight,roomy)")
    p.add_argument(
        "--cache-blocks",
        type=_cache_blocks,
        default={"tight": 64, "roomy": 192},
        help="each cache size's blocks of 32 tokens per engine (default tight=64,roomy=192: ~2 prompts, and "
        "the whole workload's blocks over the fleet)",
    )
    p.add_argument("--clients", type=_names, default=["closed", "open"], help="of closed,open (default both)")
    p.add_argument("--replicas", type=positive_ints, default=[1, 2], help="router replica counts (default 1,2)")
    p.add_argument(
        "--policies",
        type=_names,
        default=["kv", "prefix", "round_robin", "least_loaded", "sglang"],
        help="comma-separated (default kv,prefix,round_robin,least_loaded,sglang; sglang: text and chat cells, "
        "with sglang-router importable by $KVROUTE_SGLANG_PYTHON)",
    )
    p.add_argument("--seeds", type=positive_ints, default=[1, 2, 3], help="workload seeds (default 1,2,3)")
    p.add_argument("--concurrency", type=positive_int, default=4, help="closed loop: users at once (default 4)")
    p.add_argument(
        "--think-ms",
        type=float,
        default=30.0,
        help="closed loop: a user's mean think time before each turn, exponential (default 30; 0: none, and "
        "users in lockstep)",
    )
    p.add_argument("--open-rate", type=positive_float, default=16.0, help="open loop: arrivals per second (default 16)")
    p.add_argument("--max-num-seqs", type=positive_int, default=8, help="engines' batch limit (default 8)")
    p.add_argument("--stream", action="store_true", help="stream the replies (default: whole replies)")
    p.add_argument(
        "--keep-learned",
        action="store_true",
        help="keep the cost model kvroute's routers learned from one run to the next (a deployment's new "
        "replicas start from the shared model); default: every run's routers start from the priors",
    )
    p.add_argument(
        "--spread-cores",
        action="store_true",
        help="bind each vLLM server's compute to a core of its own, round robin over the cores (default: vLLM's "
        "'auto', which puts every server on the first core: engines share it, and latency says little)",
    )
    p.add_argument("--prefill-ms-per-1k", type=positive_float, default=27.0, help="sim: prefill cost (default 27)")
    p.add_argument("--decode-ms-per-step", type=positive_float, default=3.0, help="sim: decode step (default 3)")
    p.add_argument("--step-overhead-ms", type=float, default=1.0, help="sim: fixed time per step (default 1)")
    p.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=2048, help="sim: tokens per step (default 2048, vLLM's)"
    )
    p.add_argument(
        "--sim-shared-cores",
        type=non_negative_float,
        default=1.5,
        help="sim: the engines share this many cores' compute, as the vLLM servers on this machine do (default "
        "1.5: two cores, less what the clients, routers, agents and Redis beside them take; 0: each engine "
        "computes alone, as on a GPU of its own)",
    )
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("A.json", "B.json"),
        help="instead of running: each cell and policy of two --json results side by side (real vLLM and the sim)",
    )
    p.add_argument("--json", help="also write the results here")


def _soak_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=positive_float, default=10.0, help="how long the load runs (default 10)")
    p.add_argument("--rate", type=positive_float, default=10.0, help="chat turns sent per second (default 10)")
    p.add_argument("--engines", type=positive_int, default=8, help="simulated engines, each with an agent (default 8)")
    p.add_argument("--routers", type=positive_int, default=2, help="router replicas (default 2)")
    p.add_argument(
        "--num-blocks",
        type=positive_int,
        default=256,
        help="KV blocks per engine; small, so caches evict (default 256)",
    )
    p.add_argument(
        "--sample-seconds", type=positive_float, default=5.0, help="seconds between memory samples (default 5)"
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=0.5,
        help="fraction of the run before memory growth is measured (default 0.5: growth over the second half)",
    )
    p.add_argument(
        "--max-growth-mib",
        type=positive_float,
        default=16.0,
        help="largest RSS growth allowed to any process after the warm-up (default 16 MiB)",
    )
    p.add_argument("--json", help="also write the results and every sample here")


def _run(args: argparse.Namespace) -> int:
    """Run ``kvroute.bench.<name>``; a process it needed that failed is one message, exit status 1."""
    from kvroute.devstack.peers import PeerError
    from kvroute.devstack.processes import ProcessFailed

    export_redis_security_arguments(args)  # the processes it starts read them from the environment
    module = importlib.import_module(f"kvroute.bench.{args.bench_command}")
    try:
        return int(module.run_from_args(args))
    except (ProcessFailed, PeerError) as exc:
        print(f"{args.prog}: {exc}", file=sys.stderr)
        return 1
