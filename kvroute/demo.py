"""``kvroute demo``: the whole system on this machine, and what KV-aware routing buys.

Starts (unless ``--redis-url`` is given) a private Redis/Valkey server, 4 simulated engines with
an agent process each, and 2 router replicas; drives multi-turn chats over a few shared system
prompts through the routers with the ``kv`` policy, then again (caches reset) with
``round_robin``; prints a table and writes a PNG chart. Everything it started is stopped on exit,
also on Ctrl-C. With ``--keep`` the stack stays up afterwards behind 2 fresh ``kv`` routers, with
conversations going on at a reading pace, and their dashboards' URLs are printed until Ctrl-C.

Both policies get the same requests (each conversation's script is drawn from its own seed), and
each engine's cache is sized to hold the whole workload: nothing is evicted, so the duplication
read from the engines at the end of a policy's run counts every block each engine computed in
that run. It then measures only where the policy sent each conversation (``turns moved``: how
often a conversation's next turn went to another engine than its last one).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import signal
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvindex.settings import RedisSettings
from kvroute import charts
from kvroute.bench.common import cached_tokens, hit_rate, percentile, text_table, write_json
from kvroute.bench.lost_split import lost_shares, shares_text
from kvroute.bench.replay import router_lost_tokens
from kvroute.devstack.embedded_redis import redis_url_or_private
from kvroute.devstack.processes import ProcessFailed
from kvroute.devstack.stack import MODEL, CacheCensus, Stack, stream_completion
from kvtokens.tokenizer import ModelPrompts
from router.routing.scoring import Policy
from sim_engine.settings import TINY_MODEL_DIR

SYSTEM_PROMPTS = [
    "You are a meticulous travel planner. Always answer with an itinerary, a budget and a packing list. " * 4,
    "You are a senior Python reviewer. Point out bugs, then style, then performance, citing lines. " * 4,
    "You are a patient maths tutor. Explain each step, then give one practice problem with answers. " * 4,
]
WORDS = ["budget", "museum", "function", "variable", "integral", "train", "hotel", "refactor", "matrix", "ferry"]
WORDS += ["lambda", "theorem", "beach", "closure", "vector", "castle", "async", "proof", "market", "cache"]
QUESTIONS = [
    "Where should I start?",
    "What about the weekend?",
    "Can you go deeper?",
    "Summarise that for me.",
    "What would you change?",
    "Give me an example.",
    "And the costs?",
    "What are the risks?",
]
MAX_TOKENS = 24
BLOCK_SIZE = 16  # the stack's engines' block size
COLUMNS = ["policy", "hit rate", "TTFT mean ms", "TTFT p99 ms", "req/s", "duplication", "prediction exact"]
COLUMNS += ["busiest worker / mean", "turns moved", "lost load/stale/cold"]
# printed as two tables that fit an 80-column terminal: what a user sees, then why
SEEN_COLUMNS = COLUMNS[:6]
WHY_COLUMNS = ["policy", "prediction exact", "busiest / mean", "turns moved", "lost load/stale/cold"]
KEEP_THINK_S = 2.0  # with --keep: a user reads each answer this long before the next turn


@dataclass
class PolicyResult:
    policy: str
    requests: int
    hit_rate: float
    ttft_mean_ms: float
    ttft_p99_ms: float
    requests_per_s: float
    duplication: float
    prediction_accuracy: float
    max_worker_share: float
    turns_moved: float  # of the turns after a conversation's first, those sent to another engine than the last
    # Cacheable prompt tokens lost, by reason (load_tradeoff, stale_index, cold), as the routers counted them.
    lost_share: dict[str, float] | None = None


@dataclass(frozen=True)
class Workload:
    """Every conversation's user messages, fixed before the run (the answers are fixed too)."""

    scripts: list[list[str]]

    def messages(self, conversation: int, turn: int) -> list[dict[str, str]]:
        """What the client sends at ``turn`` (0-based): the system prompt, the turns before it with
        their answers, and this turn's question."""
        messages = [{"role": "system", "content": SYSTEM_PROMPTS[conversation % len(SYSTEM_PROMPTS)]}]
        for earlier, question in enumerate(self.scripts[conversation][: turn + 1]):
            if earlier:
                messages.append({"role": "assistant", "content": f"Here is my answer number {earlier - 1} for you."})
            messages.append({"role": "user", "content": question})
        return messages

    @property
    def turns(self) -> int:
        return len(self.scripts[0])


def workload(conversations: int, turns: int, first: int = 0) -> Workload:
    def question(rng: random.Random) -> str:
        detail = " ".join(rng.choice(WORDS) for _ in range(40))  # pasted notes: history outweighs the system prompt
        return f"{rng.choice(QUESTIONS)} Notes: {detail}"

    rngs = [random.Random(f"kvroute-demo-{first + i}") for i in range(conversations)]
    return Workload([[question(rng) for _ in range(turns)] for rng in rngs])


def engine_sizes(work: Workload) -> tuple[int, int]:
    """(blocks per engine, max model length): each engine can hold every conversation's longest
    prompt and its answer, so no placement makes an engine evict."""
    prompts = ModelPrompts(TINY_MODEL_DIR)
    last = work.turns - 1
    longest = [len(prompts.chat_tokens(work.messages(c, last))) + MAX_TOKENS for c in range(len(work.scripts))]
    blocks = sum(-(-tokens // BLOCK_SIZE) + 1 for tokens in longest)
    return blocks, max(4096, max(longest) + BLOCK_SIZE)


async def _chat(session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """One streamed chat completion: time to first token, usage, the routing headers."""
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS}
    reply = await stream_completion(session, url, "/v1/chat/completions", body)
    if reply.status != 200:
        raise RuntimeError(f"the router answered {reply.status}: {reply.text}")
    usage = reply.usage or {}
    return {"ttft": reply.ttft_s, "usage": usage, "worker": reply.worker, "predicted": reply.predicted_cached_tokens}


async def _conversation(
    session: aiohttp.ClientSession,
    urls: list[str],
    work: Workload,
    index: int,
    out: list[dict[str, Any]],
    think_s: float = 0.0,
) -> None:
    """One conversation's turns, one after the other, alternating between the router replicas
    (``think_s`` between them: the pace of a user reading the answers)."""
    for turn in range(work.turns):
        result = await _chat(session, urls[(index + turn) % len(urls)], work.messages(index, turn))
        out.append({**result, "conversation": index, "turn": turn})
        await asyncio.sleep(think_s)


async def _drive(policy: Policy, urls: list[str], work: Workload) -> tuple[list[dict[str, Any]], float]:
    """Every conversation at once; (each request's result, seconds taken)."""
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        progress = asyncio.create_task(_progress(policy, results, len(work.scripts) * work.turns))
        try:
            await asyncio.gather(*(_conversation(session, urls, work, i, results) for i in range(len(work.scripts))))
        finally:
            progress.cancel()
    return results, time.perf_counter() - started


async def run_policy(stack: Stack, policy: Policy, work: Workload) -> PolicyResult:
    """One policy from empty caches; the engines' caches are read before anything resets them."""
    await stack.reset_caches()
    try:
        urls = await stack.start_routers(policy, replicas=2)
        results, elapsed = await _drive(policy, urls, work)
        lost = await router_lost_tokens(urls)  # fresh routers: this run's
        census = await stack.cache_census()
    finally:
        await stack.stop_routers()
    summary = summarize(policy, results, elapsed, census, stack.engines)
    summary.lost_share = lost_shares(lost)
    return summary


async def keep_running(stack: Stack, args: argparse.Namespace) -> None:
    """``--keep``: 2 fresh kv routers over the same engines, their dashboards' URLs printed, and
    new conversations at a reading pace through them until Ctrl-C (the dashboard shows live traffic)."""
    urls = await stack.start_routers(Policy.KV, replicas=2)
    print("\nthe stack keeps running; Ctrl-C stops it. Dashboards (kv routers, live traffic):", flush=True)
    for url in urls:
        print(f"  {url}/dashboard", flush=True)
    async with aiohttp.ClientSession() as session:
        for round_ in itertools.count(1):
            more = workload(args.conversations, args.turns, first=round_ * args.conversations)
            await asyncio.gather(
                *(_conversation(session, urls, more, i, [], KEEP_THINK_S) for i in range(args.conversations))
            )


def turns_moved(results: list[dict[str, Any]]) -> float:
    """Of the turns after each conversation's first, the fraction sent to another worker than its last."""
    workers: dict[int, dict[int, str]] = defaultdict(dict)
    for r in results:
        workers[r["conversation"]][r["turn"]] = r["worker"]
    moves = later = 0
    for by_turn in workers.values():
        path = [by_turn[t] for t in sorted(by_turn)]
        later += len(path) - 1
        moves += sum(1 for a, b in itertools.pairwise(path) if a != b)
    return moves / max(later, 1)


def summarize(
    policy: Policy, results: list[dict[str, Any]], elapsed: float, census: CacheCensus, engines: int
) -> PolicyResult:
    ttfts = [1000 * r["ttft"] for r in results]
    exact = sum(1 for r in results if r["predicted"] == cached_tokens(r["usage"]))
    shares = Counter(r["worker"] for r in results)
    return PolicyResult(
        policy=policy.value,
        requests=len(results),
        hit_rate=hit_rate(r["usage"] for r in results),
        ttft_mean_ms=statistics.mean(ttfts),
        ttft_p99_ms=percentile(ttfts, 0.99),
        requests_per_s=len(results) / elapsed,
        duplication=census.duplication,
        prediction_accuracy=exact / max(len(results), 1),
        max_worker_share=max(shares.values()) / (len(results) / engines),
        turns_moved=turns_moved(results),
    )


async def _progress(policy: Policy, results: list[dict[str, Any]], total: int) -> None:
    while True:
        await asyncio.sleep(2)  # a progress line every 2 s, not a synchronization
        print(f"  {policy.value}: {len(results)}/{total} requests", file=sys.stderr, flush=True)


def render(results: list[PolicyResult]) -> str:
    """Two tables (what a user sees; why), and kv against round robin in ratios: what holds from
    machine to machine, where the absolute figures move with its speed and its load."""

    def seen(r: PolicyResult) -> list[str]:
        timing = [f"{r.ttft_mean_ms:.1f}", f"{r.ttft_p99_ms:.1f}", f"{r.requests_per_s:.1f}"]
        return [r.policy, f"{r.hit_rate:.1%}", *timing, f"{r.duplication:.1%}"]

    def why(r: PolicyResult) -> list[str]:
        shares = [f"{r.prediction_accuracy:.1%}", f"{r.max_worker_share:.2f}", f"{r.turns_moved:.1%}"]
        return [r.policy, *shares, shares_text(r.lost_share)]

    tables = [text_table(SEEN_COLUMNS, [seen(r) for r in results]), text_table(WHY_COLUMNS, [why(r) for r in results])]
    by_policy = {r.policy: r for r in results}
    kv, rr = by_policy.get("kv"), by_policy.get("round_robin")
    if kv is not None and rr is not None and rr.ttft_mean_ms > 0 and rr.duplication > 0:
        tables.append(
            f"kv against round robin: hit rate {100 * (kv.hit_rate - rr.hit_rate):+.1f} points, mean TTFT\n"
            f"{kv.ttft_mean_ms / rr.ttft_mean_ms:.2f}x, duplication {kv.duplication / rr.duplication:.2f}x"
        )
    return "\n\n".join(tables)


def chart(results: list[PolicyResult], path: Path, engines: int) -> None:
    plt = charts.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    names = [r.policy for r in results]
    for axis, values, title in (
        (axes[0], [100 * r.hit_rate for r in results], "cache hit rate (%)"),
        (axes[1], [r.ttft_mean_ms for r in results], "mean time to first token (ms)"),
        (axes[2], [100 * r.duplication for r in results], "blocks cached on >1 worker (%)"),
    ):
        axis.bar(names, values, color=["#2a7", "#888", "#c55"][: len(names)])
        axis.set_title(title, fontsize=10)
    fig.suptitle(f"kvroute demo: {engines} simulated engines, 2 router replicas, multi-turn chats")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class Interrupted(Exception):
    """Ctrl-C: the demo stopped early (everything it started is stopped)."""


async def interruptible_demo(
    args: argparse.Namespace, report: Callable[[list[PolicyResult]], None] = lambda _: None
) -> list[PolicyResult]:
    """:func:`run_demo`, which Ctrl-C stops for certain. asyncio's own Ctrl-C handling cancels the
    run once, and a cancellation that lands while a timeout fires can be swallowed (Python 3.11's
    asyncio.timeout and wait_for): the run then went on to the end and exited 0. Here each Ctrl-C
    cancels again, and a run that saw one never counts as finished."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    interrupts = 0

    def on_interrupt() -> None:
        nonlocal interrupts
        interrupts += 1
        task.cancel()

    loop.add_signal_handler(signal.SIGINT, on_interrupt)
    try:
        results = await run_demo(args, lambda: interrupts > 0, report)
    except asyncio.CancelledError:
        if interrupts:
            raise Interrupted from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    if interrupts:
        raise Interrupted
    return results


async def run_demo(
    args: argparse.Namespace,
    stopped: Callable[[], bool] = lambda: False,
    report: Callable[[list[PolicyResult]], None] = lambda _: None,
) -> list[PolicyResult]:
    """Both policies, then ``report(results)``; with ``args.keep`` the stack then keeps running
    (:func:`keep_running`) until cancelled."""
    work = workload(args.conversations, args.turns)
    num_blocks, max_model_len = engine_sizes(work)
    with redis_url_or_private(args.redis_url) as url:
        stack = Stack(RedisSettings(url=url), engines=args.engines, num_blocks=num_blocks, max_model_len=max_model_len)
        async with stack:
            print(f"started Redis at {url}, {args.engines} simulated engines with agents", file=sys.stderr)
            results = []
            for policy in (Policy.KV, Policy.ROUND_ROBIN):
                if stopped():
                    break
                what = f"{args.conversations} conversations x {args.turns} turns with policy {policy.value}"
                print(f"running {what}", file=sys.stderr)
                results.append(await run_policy(stack, policy, work))
            if not stopped():
                report(results)
                if getattr(args, "keep", False):
                    await keep_running(stack, args)
            return results


def run_from_args(args: argparse.Namespace) -> int:
    reported: list[PolicyResult] = []

    def report(results: list[PolicyResult]) -> None:
        print(render(results))
        print(
            "\n" + charts.written(lambda: chart(results, Path(args.chart), args.engines), Path(args.chart)), flush=True
        )
        if args.json:
            write_json(args.json, [asdict(r) for r in results], what="table")
        reported[:] = results

    try:
        asyncio.run(interruptible_demo(args, report))
    except (KeyboardInterrupt, Interrupted):
        if reported and args.keep:  # --keep ends with Ctrl-C: the expected way out
            print("stopped: everything the demo started has been stopped", file=sys.stderr)
            return 0
        print("interrupted: everything the demo started has been stopped", file=sys.stderr)
        return 130
    except ProcessFailed as exc:
        print(f"{args.prog}: {exc}", file=sys.stderr)
        return 1
    return 0
