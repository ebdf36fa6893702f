"""The steady load of ``kvroute bench soak``: multi-turn chats, open loop at a fixed rate.

Every ``1 / rate`` seconds the next turn of a conversation is sent: a conversation waiting for its
next turn (its previous answer has arrived), else a new one. A conversation is a tenant's system
prompt (a few tenants share theirs, so prefixes are shared across conversations) followed by 2-6
user turns of pasted notes, each answered with a fixed assistant text (the simulated engine's
words are random: what matters is the prompt the next turn sends). A conversation's turns
alternate between the router replicas. Finished conversations are dropped, so the client's own
memory does not grow with the run; the content of every conversation is drawn from its own seed.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvroute.bench.common import percentile
from kvroute.devstack.stack import MODEL, stream_completion

TENANTS = 4
TURNS = (2, 6)
MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 120.0
WORDS = ["budget", "museum", "function", "variable", "integral", "train", "hotel", "refactor", "matrix", "ferry"]
WORDS += ["lambda", "theorem", "beach", "closure", "vector", "castle", "async", "proof", "market", "cache"]
ERROR_EXAMPLES = 5  # failure messages kept verbatim; the rest are counted by kind


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def system_prompt(tenant: int) -> str:
    return f"You are assistant {tenant}. " + _words(random.Random(f"soak-tenant-{tenant}"), 120)


@dataclass
class Conversation:
    number: int
    turns: int
    rng: random.Random
    messages: list[dict[str, str]]
    turn: int = 0

    @classmethod
    def new(cls, number: int) -> Conversation:
        rng = random.Random(f"soak-conversation-{number}")
        tenant = rng.randrange(TENANTS)
        return cls(number, rng.randint(*TURNS), rng, [{"role": "system", "content": system_prompt(tenant)}])

    def next_messages(self) -> list[dict[str, str]]:
        question = {"role": "user", "content": f"Turn {self.turn}. Notes: {_words(self.rng, 30)}"}
        return [*self.messages, question]

    def answered(self, sent: list[dict[str, str]]) -> None:
        self.messages = [*sent, {"role": "assistant", "content": f"Here is answer {self.turn} for you."}]
        self.turn += 1


@dataclass
class LoadStats:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    failures: Counter[str] = field(default_factory=Counter)  # by kind: "status 503", "TimeoutError"
    examples: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)

    def fail(self, kind: str, message: str) -> None:
        self.failed += 1
        self.failures[kind] += 1
        if len(self.examples) < ERROR_EXAMPLES:
            self.examples.append(message)

    def summary(self, seconds: float) -> dict[str, Any]:
        ttft_ms = [1000 * t for t in self.ttft_s]
        return {
            "sent": self.sent,
            "ok": self.ok,
            "failed": self.failed,
            "failures": dict(self.failures),
            "failure_examples": self.examples,
            "requests_per_s": round(self.sent / max(seconds, 1e-9), 2),
            "ttft_mean_ms": round(sum(ttft_ms) / max(len(ttft_ms), 1), 1),
            "ttft_p99_ms": round(percentile(ttft_ms, 0.99), 1),
        }


class ChatLoad:
    """Turns of multi-turn chats sent at ``rate`` per second through ``urls`` (router replicas)."""

    def __init__(self, urls: list[str], rate: float) -> None:
        self.urls = urls
        self.rate = rate
        self.stats = LoadStats()
        self._waiting: deque[Conversation] = deque()
        self._conversations = 0

    async def run(self, seconds: float) -> None:
        """Send for ``seconds``, then wait for the answers still on their way."""
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        pending: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            started = time.perf_counter()
            sent = 0
            while (due := started + sent / self.rate) < started + seconds:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                task = asyncio.create_task(self._turn(session, self._next_conversation()))
                pending.add(task)
                task.add_done_callback(pending.discard)
                sent += 1
            await asyncio.gather(*pending)

    def _next_conversation(self) -> Conversation:
        if self._waiting:
            return self._waiting.popleft()
        self._conversations += 1
        return Conversation.new(self._conversations)

    async def _turn(self, session: aiohttp.ClientSession, conversation: Conversation) -> None:
        messages = conversation.next_messages()
        url = self.urls[(conversation.number + conversation.turn) % len(self.urls)]
        body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS}
        self.stats.sent += 1
        try:
            reply = await stream_completion(session, url, "/v1/chat/completions", body)
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.stats.fail(type(exc).__name__, f"{url}: {type(exc).__name__}: {exc}")
            return  # this conversation ends here
        if reply.status != 200:
            self.stats.fail(f"status {reply.status}", f"{url}: {reply.status} {reply.text}")
            return
        if reply.usage is None:  # the stream ended before its last event
            self.stats.fail("incomplete stream", f"{url}: a 200 stream without its usage event")
            return
        self.stats.ok += 1
        self.stats.ttft_s.append(reply.ttft_s)
        conversation.answered(messages)
        if conversation.turn < conversation.turns:
            self._waiting.append(conversation)

    @property
    def conversations(self) -> int:
        return self._conversations
