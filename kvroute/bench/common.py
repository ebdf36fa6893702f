"""What the benchmarks share, written once (the processes they start and wait for are
:mod:`kvroute.devstack.processes`'):

* figures: :func:`percentile`, :func:`cached_tokens` / :func:`hit_rate` (from OpenAI ``usage``);
* load: :func:`closed_loop` (N clients, each sending its next request when its last one ends);
* results: :func:`text_table`, :func:`print_fields`, :func:`write_json`.

It imports nothing from the rest of the project.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from redis.asyncio import Redis

from kvindex.settings import RedisSettings
from kvservice.lifecycle import StartupError


def single_redis_client(url: str) -> Redis:
    """The index's client for a benchmark that reads one server's counters (INFO, MEMORY)."""
    client = RedisSettings.from_env(url=url).client()
    if not isinstance(client, Redis):
        raise StartupError(f"this benchmark measures one Redis server; {url} is a cluster (see --cluster)")
    return client


# ---------------------------------------------------------------------------------------- figures


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` (0..1) percentile by nearest rank, e.g. ``percentile(latencies, 0.99)``; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cached_tokens(usage: Mapping[str, Any]) -> int:
    """Prompt tokens the engine served from its prefix cache, from an OpenAI ``usage`` object."""
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def hit_rate(usages: Iterable[Mapping[str, Any]]) -> float:
    """Cached prompt tokens / prompt tokens over ``usages``."""
    prompt = cached = 0
    for usage in usages:
        prompt += int(usage.get("prompt_tokens", 0))
        cached += cached_tokens(usage)
    return cached / max(prompt, 1)


# -------------------------------------------------------------------------------------- processes


# ------------------------------------------------------------------------------------ load


async def closed_loop(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    seconds: float,
    concurrency: int,
    body: Callable[[int, int], dict[str, Any]],
) -> tuple[int, float]:
    """``concurrency`` clients, client ``i`` posting ``body(i, n)`` (its n-th request) to
    ``urls[i % len(urls)]`` until ``seconds`` have passed; (requests answered 200, seconds taken)."""
    done = 0
    started = time.perf_counter()
    deadline = started + seconds

    async def client(i: int) -> None:
        nonlocal done
        url = urls[i % len(urls)]
        n = 0
        while time.perf_counter() < deadline:
            async with session.post(url, json=body(i, n)) as response:
                await response.read()
                done += response.status == 200
            n += 1

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return done, time.perf_counter() - started


# ---------------------------------------------------------------------------------------- results


def text_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Left-aligned columns two spaces apart, headers first; no trailing spaces."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


def print_fields(results: Mapping[str, Any]) -> None:
    """One ``name  value`` line per result, names padded to one width."""
    width = max((len(k) for k in results), default=0)
    for key, value in results.items():
        print(f"{key.ljust(width)}  {value}")


def write_json(path: str | Path, data: Any, what: str = "") -> None:
    """Write ``data`` as indented JSON; with ``what``, say where it went (``what written to PATH``)."""
    Path(path).write_text(json.dumps(data, indent=2))
    if what:
        print(f"{what} written to {Path(path).resolve()}")
