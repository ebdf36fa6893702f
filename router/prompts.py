"""A request's prompt token ids, identical to the engine's.

With a model directory configured (``--tokenizer MODEL=DIR``) the router tokenizes itself (long
texts off the event loop); otherwise it asks a worker's ``/tokenize`` and caches the answer.
Token-id prompts are used as they are.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from router.tokenizer import ModelPrompts, PromptError

OFF_LOOP_CHARS = 2_000  # longer texts are tokenized in a thread
CACHE_ENTRIES = 4_096


class BadPrompt(ValueError):
    """The request's prompt or messages are malformed (400)."""


class Tokenization:
    def __init__(self, tokenizer_dirs: dict[str, Path], session: aiohttp.ClientSession) -> None:
        self._models = {model: ModelPrompts(directory) for model, directory in tokenizer_dirs.items()}
        self._session = session
        self._cache: OrderedDict[str, list[int]] = OrderedDict()

    async def completion(self, model: str, body: dict[str, Any], worker_url: str) -> Sequence[int]:
        """Tokens of a completion's prompt (for a batch: its first prompt, which routes it)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of prompts: the first one routes it
        if isinstance(prompt, list) and prompt:
            try:  # array('I') checks every id in C, and hashing reads its bytes as they are
                return array("I", prompt)
            except (TypeError, OverflowError):
                raise BadPrompt("token ids must be integers in 0..4294967295") from None
        if not isinstance(prompt, str) or not prompt:
            raise BadPrompt("'prompt' must be a string, an array of token ids, or an array of those")
        add_special = bool(body.get("add_special_tokens", True))
        prompts = self._models.get(model)
        if prompts is not None:
            return await self._run(prompts.encode, prompt, add_special, heavy=len(prompt) > OFF_LOOP_CHARS)
        return await self._ask(worker_url, {"model": model, "prompt": prompt, "add_special_tokens": add_special})

    async def chat(self, model: str, body: dict[str, Any], worker_url: str) -> list[int]:
        messages = body.get("messages")
        add_generation_prompt = bool(body.get("add_generation_prompt", True))
        if not isinstance(messages, list) or not messages:
            raise BadPrompt("'messages' must be a non-empty array")
        prompts = self._models.get(model)
        if prompts is None:
            request = {"model": model, "messages": messages, "add_generation_prompt": add_generation_prompt}
            return await self._ask(worker_url, request)
        size = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
        try:
            return await self._run(prompts.chat_tokens, messages, add_generation_prompt, heavy=size > OFF_LOOP_CHARS)
        except PromptError as exc:
            raise BadPrompt(str(exc)) from None

    @staticmethod
    async def _run(function: Any, *args: Any, heavy: bool) -> list[int]:
        if heavy:
            return list(await asyncio.get_running_loop().run_in_executor(None, function, *args))
        return list(function(*args))

    async def _ask(self, worker_url: str, request: dict[str, Any]) -> list[int]:
        key = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        async with self._session.post(f"{worker_url}/tokenize", json=request) as response:
            if response.status == 400:
                raise BadPrompt((await response.text())[:500])
            response.raise_for_status()
            tokens = list((await response.json())["tokens"])
        self._cache[key] = tokens
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return tokens
