"""A request's prompt token ids, identical to the engine's.

With a model directory configured (``--tokenizer MODEL=DIR``) the router tokenizes itself (long
texts off the event loop); otherwise it asks a worker's ``/tokenize`` and caches the answer (by
size: :class:`~router.prompts.token_cache.TokenCache`). Token-id prompts are used as they are. A prompt
longer than ``max_prompt_tokens`` is refused (:class:`PromptTooLong`, 413) before it is hashed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtokens.tokenizer import ModelPrompts, PromptError
from router.prompts.body import BodyError, decode_token_answer, too_long
from router.prompts.token_cache import TokenCache
from router.prompts.token_memo import TokenMemo

if TYPE_CHECKING:
    from router.upstream.pool import UpstreamPool

OFF_LOOP_CHARS = 2_000  # longer texts are tokenized in a thread
SLICE_PIECES = 32  # much new text is put together this many pieces (~8k characters, ~1 ms) at a time
DEFAULT_MAX_PROMPT_TOKENS = 1 << 20


class TokenizeFailed(Exception):
    """A worker could not tokenize a prompt for the router (it answered no tokens)."""


class BadPrompt(ValueError):
    """The request's prompt or messages are malformed (400)."""


class PromptTooLong(BadPrompt):
    """The prompt has more tokens than this router accepts (413)."""


class Tokenization:
    def __init__(
        self,
        tokenizer_dirs: dict[str, Path],
        upstream: UpstreamPool | None,
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    ) -> None:
        self._models = {model: ModelPrompts(directory) for model, directory in tokenizer_dirs.items()}
        # Only what is new in a text is tokenized (router.prompts.token_memo); None: a tokenizer that cannot
        # be cut exactly, tokenized whole every time.
        self.memos = {model: TokenMemo.for_tokenizer(p.tokenizer) for model, p in self._models.items()}
        self._upstream = upstream  # the workers' connection pool, for /tokenize (None: local tokenizers only)
        self.max_prompt_tokens = max_prompt_tokens
        self.cache = TokenCache()

    def _checked(self, tokens: Sequence[int]) -> Sequence[int]:
        if len(tokens) > self.max_prompt_tokens:
            raise PromptTooLong(too_long(len(tokens), self.max_prompt_tokens))
        return tokens

    async def completion(self, model: str, body: dict[str, Any], worker_url: str) -> Sequence[int]:
        """Tokens of a completion's prompt (for a batch: its first prompt, which routes it)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list | array):
            prompt = prompt[0]  # a batch of prompts: the first one routes it
        if isinstance(prompt, array) and prompt:  # a long one, decoded in slices (router.prompts.body)
            return self._checked(prompt)
        if isinstance(prompt, list) and prompt:
            self._checked(prompt)  # before building anything from it
            try:  # array('I') checks every id in C, and hashing reads its bytes as they are
                return array("I", prompt)
            except (TypeError, OverflowError):
                raise BadPrompt("token ids must be integers in 0..4294967295") from None
        if prompt is None or prompt == "" or (isinstance(prompt, list | array) and not prompt):
            raise BadPrompt("'prompt' is missing or empty")
        if not isinstance(prompt, str):
            raise BadPrompt("'prompt' must be a string, an array of token ids, or an array of those")
        add_special = bool(body.get("add_special_tokens", True))
        prompts = self._models.get(model)
        if prompts is not None:
            return self._checked(await self._encode(model, prompts, prompt, add_special))
        return await self._ask(worker_url, {"model": model, "prompt": prompt, "add_special_tokens": add_special})

    async def chat(self, model: str, body: dict[str, Any], worker_url: str) -> Sequence[int]:
        messages = body.get("messages")
        add_generation_prompt = bool(body.get("add_generation_prompt", True))
        if not isinstance(messages, list) or not messages:
            raise BadPrompt("'messages' must be a non-empty array")
        prompts = self._models.get(model)
        if prompts is None:
            request = {"model": model, "messages": messages, "add_generation_prompt": add_generation_prompt}
            return await self._ask(worker_url, request)
        try:  # rendering is cheap (~20 us for 2.6k tokens); tokenizing the rendered text is not
            text = prompts.render_chat(messages, add_generation_prompt)
        except PromptError as exc:
            raise BadPrompt(str(exc)) from None
        return self._checked(await self._encode(model, prompts, text, add_special=False))

    async def _encode(self, model: str, prompts: ModelPrompts, text: str, add_special: bool) -> Sequence[int]:
        """``text``'s ids, tokenizing only the pieces the model's memo does not remember; long new
        pieces in a thread (the tokenizer releases the GIL)."""
        memo = self.memos.get(model)
        if memo is None:
            return await self._run(prompts.encode, text, add_special, heavy=len(text) > OFF_LOOP_CHARS)
        pieces = memo.pieces(text)
        new = memo.new_pieces(pieces)
        if sum(map(len, new)) > OFF_LOOP_CHARS:
            await self._remember_in_slices(memo, new)
            return memo.assemble(pieces, add_special)
        missing = memo.words_missing(new)
        if not missing:
            return memo.assemble(pieces, add_special)
        fresh = await self._run(memo.encode_pieces, missing, heavy=False)
        memo.learn(missing, fresh)
        return memo.assemble(pieces, add_special, dict(zip(missing, fresh, strict=True)))

    async def _remember_in_slices(self, memo: TokenMemo, new: list[str]) -> None:
        """Much new text: its pieces put together (and remembered) a slice at a time, the event
        loop free between slices. Word by word, ~0.7 us a word even when every word is known, a
        burst of long new prompts held the loop for tens of milliseconds (past the decisions'
        Redis budgets, and every other request with it); unknown words of a slice go to the
        tokenizer in a thread when there are many."""
        for start in range(0, len(new), SLICE_PIECES):
            pieces = new[start : start + SLICE_PIECES]
            missing = memo.words_missing(pieces)
            fresh = await self._run(memo.encode_pieces, missing, heavy=sum(map(len, missing)) > OFF_LOOP_CHARS)
            memo.learn(missing, fresh)
            memo.remember(pieces, dict(zip(missing, fresh, strict=True)))
            await asyncio.sleep(0)

    @staticmethod
    async def _run(function: Any, *args: Any, heavy: bool) -> list[Any]:
        if heavy:
            return list(await asyncio.get_running_loop().run_in_executor(None, function, *args))
        return list(function(*args))

    async def _ask(self, worker_url: str, request: dict[str, Any]) -> Sequence[int]:
        key = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        if self._upstream is None:
            raise TokenizeFailed(f"no tokenizer for model {request['model']!r} and no worker connection")
        reply = await self._upstream.post(
            f"{worker_url}/tokenize", json.dumps(request).encode(), [("Content-Type", "application/json")]
        )
        try:
            answer = await reply.read()
        finally:
            reply.close()
        if reply.status == 400:
            raise BadPrompt(answer[:500].decode("utf-8", "replace"))
        if reply.status != 200:
            raise TokenizeFailed(f"{worker_url}/tokenize answered {reply.status}")
        try:  # a long answer is decoded in slices, like a long token-id prompt
            ids = await decode_token_answer(answer, self.max_prompt_tokens)
        except BodyError as exc:
            if exc.status == 413:
                raise PromptTooLong(str(exc)) from None
            raise TokenizeFailed(f"{worker_url}/tokenize: {exc}") from None
        self.cache.put(key, ids)
        return ids
