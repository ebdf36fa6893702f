"""What the simulated engine sends back for a generation (sim_engine/server.py's ``_generate``):
the tokens as they come, a whole reply's texts, a stream of server-sent events, the usage.

A request that finished with an error (a decode leg whose KV load failed, vLLM's
``kv_load_failure_policy`` "fail") ends its stream as vLLM's OpenAI server does: an event
``{"error": {...}}`` (a chat stream opens the choice with its role first), no usage, ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aiohttp import web

from sim_engine import api
from sim_engine.types import SimRequest

if TYPE_CHECKING:
    from sim_engine.server import _State as State

ERROR = "error"  # vLLM's finish reason for a request that failed


def usage(requests: list[SimRequest]) -> dict[str, Any]:
    return api.usage(
        sum(len(r.prompt) for r in requests),
        sum(len(r.output) for r in requests),
        sum(r.reported_cached_tokens for r in requests),
    )


async def collect(state: State, request: SimRequest) -> str:
    async for _ in _tokens(state, request):
        pass
    return state.prompts.decode(request.output)


async def _tokens(state: State, request: SimRequest) -> AsyncIterator[int]:
    index = 0
    while (token := await request.tokens.get()) is not None:
        state.histograms.token(request, index)
        index += 1
        yield token
    state.histograms.finished(request, time.monotonic())


async def _pump(
    state: State, index: int, request: SimRequest, queue: asyncio.Queue[tuple[int, str, str | None]]
) -> None:
    """Put one choice's text deltas on ``queue`` as (index, text, finish reason or None)."""
    sent = ""
    first = True
    async for _ in _tokens(state, request):
        text = state.prompts.decode(request.output)
        if text.startswith(sent) and not text.endswith("\ufffd"):  # hold back half a character
            finish = None if len(request.output) < request.max_tokens else "length"
            await queue.put((index, text[len(sent) :], finish))
            sent, first = text, False
    if request.failed:
        await queue.put((index, "", ERROR))
    elif first or len(sent) < len(state.prompts.decode(request.output)):
        await queue.put((index, state.prompts.decode(request.output)[len(sent) :], "length"))


async def stream(
    request: web.Request, state: State, generation: api.Generation, request_id: str, submitted: list[SimRequest]
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(payload: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(payload)}\n\n".encode())

    queue: asyncio.Queue[tuple[int, str, str | None]] = asyncio.Queue()
    model = generation.lora.name if generation.lora is not None else state.settings.model
    chat = generation.chat
    tasks = [asyncio.create_task(_pump(state, i, r, queue)) for i, r in enumerate(submitted)]
    started = dict.fromkeys(range(len(submitted)), False)
    try:
        finished = 0
        while finished < len(submitted):
            index, text, finish = await queue.get()
            if chat and not started[index]:  # vLLM opens each chat choice with the role alone
                await send(api.chunk(request_id, model, chat, index, "", None, first=True))
            started[index] = True
            if finish == ERROR:
                await send(api.generation_error().body())
                break
            await send(api.chunk(request_id, model, chat, index, text, finish))
            finished += finish is not None
        else:
            if generation.include_usage:
                await send(api.usage_chunk(request_id, model, chat, usage(submitted)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    finally:
        for task in tasks:
            task.cancel()
    return response
