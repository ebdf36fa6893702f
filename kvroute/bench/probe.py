"""What the engines held when each request was sent: the ground truth under a router's hit rate.

With ``--probe``, just before each request the bench asks every simulated engine what its prefix
cache would give that prompt now (``POST /debug/match``, the engines' own block pools, as the
greedy oracle asks), and a run's hit rate splits into three parts, each a share of the prompt
tokens:

* ``best``: the longest cached prefix any engine held at the send: what a router with perfect,
  instant knowledge could have had then. Where earlier prompts were put, and what they evicted,
  shapes it (two routers' ``best`` differ by their histories, not by this decision);
* ``choice_loss``: ``best`` less what the chosen engine held at the send: what the decision gave
  up, knowingly (a shorter queue) or not (a stale index, a wrong survival estimate);
* ``schedule_loss``: what the chosen engine held at the send less what it reported: evicted by
  the prompts ahead of it there before it was scheduled (negative: gained, a prompt ahead
  computed part of it).

So ``hit rate = best - choice_loss - schedule_loss``. The greedy oracle's choice loss is zero
by construction; kv's tells whether a gap to it is in the decisions or in the history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvroute.bench.common import cached_tokens
from kvroute.devstack.oracle import cached_prefixes
from kvtokens.tokenizer import ModelPrompts


@dataclass
class Prober:
    """Asks every engine at ``engine_urls`` for a prompt's cached prefix; text prompts are
    tokenized with ``prompts`` (the engines' tokenizer), as the engines tokenize them."""

    engine_urls: Sequence[str]
    prompts: ModelPrompts

    async def cached(self, session: aiohttp.ClientSession, prompt: list[int] | str) -> list[int]:
        """Each engine's cached prefix of ``prompt`` now, in tokens (-1: the engine did not answer)."""
        tokens = self.prompts.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
        return await cached_prefixes(session, self.engine_urls, tokens)


def engine_of(worker: str | None, engine_urls: Sequence[str]) -> int | None:
    """The index of the engine a reply came from: ``worker`` is a kvroute worker id (the engine's
    URL and ``#`` its data-parallel rank) or an engine URL (the oracle's); None when unknown."""
    if not worker:
        return None
    url = worker.split("#", 1)[0].rstrip("/")
    return next((i for i, engine in enumerate(engine_urls) if engine.rstrip("/") == url), None)


def probe_split(results: Sequence[dict[str, Any]], engine_urls: Sequence[str]) -> dict[str, float] | None:
    """A run's hit rate split by the probes (shares of the prompt tokens of the requests that were
    answered and probed); the losses only over the requests whose engine is known. None when no
    request was probed."""
    probed = [r for r in results if not r["failed"] and r.get("probe")]
    prompt = sum(r["usage"].get("prompt_tokens", 0) for r in probed)
    if not probed or prompt <= 0:
        return None
    best = sum(max(r["probe"]) for r in probed)
    known = [(r, i) for r in probed if (i := engine_of(r.get("worker"), engine_urls)) is not None]
    choice = sum(max(r["probe"]) - max(r["probe"][i], 0) for r, i in known)
    schedule = sum(max(r["probe"][i], 0) - cached_tokens(r["usage"]) for r, i in known)
    return {
        "best": round(best / prompt, 4),
        "choice_loss": round(choice / prompt, 4),
        "schedule_loss": round(schedule / prompt, 4),
        "hit_rate": round(sum(cached_tokens(r["usage"]) for r in probed) / prompt, 4),
        "choices_lost": sum(1 for r, i in known if max(r["probe"]) > r["probe"][i]),
        "known": len(known) / len(probed),
    }


def split_text(split: dict[str, float] | None) -> str:
    """``best - choice - schedule``, in percent of the prompt tokens (``-`` without probes)."""
    if not split:
        return "-"
    return f"{split['best']:.1%} - {split['choice_loss']:.1%} - {split['schedule_loss']:.1%}"
