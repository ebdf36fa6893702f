"""The greedy oracle: a reference router with perfect, instant knowledge of the engines' caches.

For every completion it asks each simulated engine what its prefix cache would give this very
prompt now (``POST /debug/match``, the engine's own block pool, not an index), sends the request
to the engine with the longest cached prefix, ties to the one with the fewest requests this
oracle has in flight there, then at random. No index, no lag, no guess: what kvroute's routing is
judged against in ``kvroute bench regimes`` (``--policies ...,greedy_oracle``). It is greedy, not
optimal: it knows what is cached, not what the requests in flight will evict, and it never trades
a cache hit for a shorter queue.

One process serves every "replica" of a run (it knows everything; several of them would not).
Run as ``python -m kvroute.devstack.oracle --port P --worker-urls URL [URL ...]``; it tokenizes
text and chats with the model directory's tokenizer (``--tokenizer``, the tiny model's by default)
exactly as the simulated engines do, and asks them with token ids.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvtokens.tokenizer import ModelPrompts, PromptError

HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"})


async def cached_prefixes(
    session: aiohttp.ClientSession, engine_urls: Sequence[str], tokens: list[int], salt: Any = None
) -> list[int]:
    """Every simulated engine's cached prefix of ``tokens`` now, in tokens, as its own block pool
    would give it (``POST /debug/match``); -1 for an engine that does not answer."""
    probe = {"prompt": tokens, **({"cache_salt": salt} if salt else {})}

    async def ask(url: str) -> int:
        try:
            async with session.post(url + "/debug/match", json=probe) as response:
                return int((await response.json())["cached_tokens"]) if response.status == 200 else -1
        except (aiohttp.ClientError, ValueError, KeyError):
            return -1

    return list(await asyncio.gather(*(ask(url) for url in engine_urls)))


@dataclass
class Oracle:
    """Routing state: the engines, and how many requests it has in flight on each."""

    workers: list[str]
    prompts: ModelPrompts
    inflight: Counter[str] = field(default_factory=Counter)
    rng: random.Random = field(default_factory=random.Random)
    session: aiohttp.ClientSession | None = None

    def tokens(self, body: dict[str, Any], chat: bool) -> list[int]:
        """The first prompt's token ids as the engine computes them (a PromptError when malformed)."""
        if chat:
            messages = body.get("messages")  # checked by chat_tokens (a PromptError)
            return self.prompts.chat_tokens(messages, bool(body.get("add_generation_prompt", True)))  # type: ignore[arg-type]
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch routes by its first prompt
        if isinstance(prompt, str):
            return self.prompts.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        raise PromptError("'prompt' must be a string or an array of token ids")

    async def cached(self, tokens: list[int], salt: Any) -> list[int]:
        """Every engine's cached prefix of ``tokens`` now (:func:`cached_prefixes`)."""
        assert self.session is not None
        return await cached_prefixes(self.session, self.workers, tokens, salt)

    def choose(self, cached: list[int]) -> tuple[str, int]:
        """The longest cached prefix; ties to the fewest in flight, then at random."""
        ranked = sorted(
            range(len(self.workers)),
            key=lambda i: (-cached[i], self.inflight[self.workers[i]], self.rng.random()),
        )
        return self.workers[ranked[0]], max(cached[ranked[0]], 0)


ORACLE = web.AppKey("oracle", Oracle)


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}}, status=status
    )


async def _route(request: web.Request) -> web.StreamResponse:
    oracle = request.app[ORACLE]
    raw = await request.read()
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        tokens = oracle.tokens(body, request.path.endswith("/chat/completions"))
    except (ValueError, PromptError) as exc:
        return _error(400, str(exc))
    worker, cached = oracle.choose(await oracle.cached(tokens, body.get("cache_salt")))
    oracle.inflight[worker] += 1
    try:
        return await _forward(request, oracle, worker, raw, cached)
    finally:
        oracle.inflight[worker] -= 1


async def _forward(request: web.Request, oracle: Oracle, worker: str, raw: bytes, cached: int) -> web.StreamResponse:
    assert oracle.session is not None
    headers = {"Content-Type": "application/json"}
    try:
        async with oracle.session.post(worker + request.path, data=raw, headers=headers) as upstream:
            reply = web.StreamResponse(status=upstream.status)
            for name, value in upstream.headers.items():
                if name.lower() not in HOP_BY_HOP:
                    reply.headers[name] = value
            reply.headers["x-kvroute-worker"] = worker
            reply.headers["x-kvroute-cached-tokens"] = str(cached)
            await reply.prepare(request)
            async for chunk in upstream.content.iter_any():
                await reply.write(chunk)
            await reply.write_eof()
            return reply
    except aiohttp.ClientError as exc:
        return _error(502, f"the engine failed: {type(exc).__name__}")


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


def create_app(oracle: Oracle) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[ORACLE] = oracle

    async def session(app: web.Application) -> Any:
        connector = aiohttp.TCPConnector(limit=0)
        oracle.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600))
        yield
        await oracle.session.close()

    app.cleanup_ctx.append(session)
    app.router.add_get("/health", _health)
    app.router.add_post("/v1/completions", _route)
    app.router.add_post("/v1/chat/completions", _route)
    return app


def main(argv: list[str] | None = None) -> int:
    from sim_engine.settings import TINY_MODEL_DIR

    parser = argparse.ArgumentParser(prog="python -m kvroute.devstack.oracle", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker-urls", nargs="+", required=True, help="the simulated engines' base URLs")
    parser.add_argument("--tokenizer", type=Path, default=TINY_MODEL_DIR, help="the model directory engines use")
    args = parser.parse_args(argv)
    try:
        prompts = ModelPrompts(args.tokenizer)
    except (OSError, ValueError) as exc:
        parser.error(f"--tokenizer {args.tokenizer}: {exc}")
    oracle = Oracle([u.rstrip("/") for u in args.worker_urls], prompts)
    web.run_app(create_app(oracle), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
