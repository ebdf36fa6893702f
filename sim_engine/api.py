"""vLLM's OpenAI-compatible request and response shapes (pure: parsing and building JSON).

Requests are validated here; anything malformed raises :class:`ApiError` with the HTTP status
and an OpenAI-style message, which the server returns as ``{"error": {...}}``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvtokens.sampling import SamplingError, check_sampling
from kvtokens.tokenizer import ModelPrompts, PromptError
from sim_engine.block_pool import CacheKeys
from sim_engine.lora import LoraAdapter, LoraAdapters

DEFAULT_MAX_TOKENS = 16


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        kinds = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLarge", 500: "InternalServerError"}
        kind = kinds.get(self.status, "ServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class Generation:
    """What to run: one or more prompts (a batch for /v1/completions), and how to answer."""

    prompts: list[list[int]]
    max_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: str | None
    chat: bool
    return_token_ids: bool = False
    lora: LoraAdapter | None = None  # the adapter the request names as its model
    kv_transfer_params: Any = None  # as sent (sim_engine/kv_transfer_api.py reads them)

    @property
    def keys(self) -> CacheKeys:
        """What keeps its cached blocks apart from other requests' (vLLM's extra keys)."""
        if self.lora is None:
            return CacheKeys(self.cache_salt)
        return CacheKeys(self.cache_salt, self.lora.name, self.lora.lora_id)


def _int_param(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ApiError(400, f"'{name}' must be a positive integer, got {value!r}", name)
    return value


def _common(body: dict[str, Any], lora: LoraAdapter | None, chat: bool, prompts: list[list[int]]) -> Generation:
    try:
        check_sampling(body)  # vLLM answers 400 for these; the simulated engine samples nothing
    except SamplingError as exc:
        raise ApiError(400, str(exc), exc.param) from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(400, "'cache_salt' must be a non-empty string", "cache_salt")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    return Generation(
        prompts,
        _int_param(body, name, DEFAULT_MAX_TOKENS),
        stream,
        bool(options.get("include_usage")),
        salt,
        chat,
        bool(body.get("return_token_ids")),
        lora,
        body.get("kv_transfer_params"),
    )


def check_model(
    body: Any, model: str, adapters: LoraAdapters | None = None
) -> tuple[dict[str, Any], LoraAdapter | None]:
    """The body, and the LoRA adapter it names (None: the base model); 404 for another model."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    requested = body.get("model", model)
    if requested == model:
        return body, None
    adapter = adapters.get(requested) if adapters is not None and isinstance(requested, str) else None
    if adapter is None:
        raise ApiError(404, f"The model `{requested}` does not exist.", "model")
    return body, adapter


def _token_list(value: Any, vocab_size: int) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        bad = [t for t in value if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is out of vocabulary (0..{vocab_size - 1})", "prompt")
        return list(value)
    return None


def parse_completion(body: Any, model: str, prompts: ModelPrompts, adapters: LoraAdapters | None = None) -> Generation:
    body, lora = check_model(body, model, adapters)
    raw = body.get("prompt")
    add_special = body.get("add_special_tokens", True)
    vocab = prompts.vocab_size
    if raw is None or raw == "" or raw == []:
        raise ApiError(400, "'prompt' is missing or empty", "prompt")
    single = raw if isinstance(raw, str) else _token_list(raw, vocab)
    if single is not None:
        items: list[Any] = [single]
    elif isinstance(raw, list):
        items = raw
    else:
        raise ApiError(400, "'prompt' must be a string, an array of token ids, or an array of those", "prompt")
    out = []
    for item in items:
        tokens = prompts.encode(item, add_special_tokens=bool(add_special)) if isinstance(item, str) else item
        if not isinstance(tokens, list) or (not isinstance(item, str) and _token_list(item, vocab) is None):
            raise ApiError(400, "each prompt must be a string or a non-empty array of token ids", "prompt")
        if not tokens:
            raise ApiError(400, "the prompt is empty", "prompt")
        out.append(tokens)
    return _common(body, lora, False, out)


def parse_chat(body: Any, model: str, prompts: ModelPrompts, adapters: LoraAdapters | None = None) -> Generation:
    body, lora = check_model(body, model, adapters)
    try:
        tokens = prompts.chat_tokens(body.get("messages"), bool(body.get("add_generation_prompt", True)))
    except PromptError as exc:
        raise ApiError(400, str(exc), "messages") from None
    return _common(body, lora, True, [tokens])


def tokenize(
    body: Any, model: str, prompts: ModelPrompts, max_model_len: int, adapters: LoraAdapters | None = None
) -> dict[str, Any]:
    body, _ = check_model(body, model, adapters)  # an adapter tokenizes as its base model
    if "messages" in body:
        try:
            tokens = prompts.chat_tokens(body["messages"], bool(body.get("add_generation_prompt", True)))
        except PromptError as exc:
            raise ApiError(400, str(exc), "messages") from None
    elif isinstance(body.get("prompt"), str):
        tokens = prompts.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
    else:
        raise ApiError(400, "/tokenize needs a string 'prompt' or 'messages'", "prompt")
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": None}


def generation_error() -> ApiError:
    """What vLLM answers for a request that finished with an error (its GenerationError: a KV load
    that failed under kv_load_failure_policy "fail"): a bare 500, in a stream an error event."""
    return ApiError(500, "Internal server error")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def chunk(
    request_id: str, model: str, chat: bool, index: int, text: str, finish: str | None, first: bool = False
) -> dict[str, Any]:
    """One streamed choice delta."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        kind = "text_completion"
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(request_id: str, model: str, chat: bool, usage_body: dict[str, Any]) -> dict[str, Any]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage_body,
    }


def completion(
    request_id: str,
    model: str,
    chat: bool,
    texts: list[str],
    usage_body: dict[str, Any],
    token_ids: list[tuple[list[int], list[int]]] | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) response; ``token_ids``: (prompt, output) per choice, returned as
    vLLM does when the request sets ``return_token_ids``."""
    if chat:
        choices: list[dict[str, Any]] = [
            {"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None, "finish_reason": "length"}
            for i, t in enumerate(texts)
        ]
        kind = "chat.completion"
    else:
        choices = [
            {"index": i, "text": t, "logprobs": None, "finish_reason": "length", "stop_reason": None}
            for i, t in enumerate(texts)
        ]
        kind = "text_completion"
    for choice, (prompt, output) in zip(choices, token_ids or [], strict=False):
        choice["prompt_token_ids"], choice["token_ids"] = prompt, output
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_body,
    }
