"""A model's prompts as its engine sees them: the token ids of a text prompt or of a chat.

The index is keyed by token ids, so whoever hashes a prompt (the router, the simulated engine)
must tokenize it exactly as vLLM does: the model directory's ``tokenizer.json`` (Hugging Face
``tokenizers``) and its chat template (``chat_template.jinja`` or the ``chat_template`` of
``tokenizer_config.json``), rendered the way transformers renders it (a sandboxed jinja2
environment with ``trim_blocks`` and ``lstrip_blocks``). Text completions add the tokenizer's
special tokens (vLLM's ``add_special_tokens`` defaults to true there); rendered chats do not.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class PromptError(ValueError):
    """A prompt or chat that cannot be turned into tokens (the message says why)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class _ChatEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with each template's globals a plain dict: jinja2's ChainMap (so
    that globals changed after a template is loaded are seen, which these never are) was merged
    into a dict in Python on every render, half of a chat's ~20 us render."""

    def make_globals(self, d: Mapping[str, Any] | None) -> dict[str, Any]:  # type: ignore[override]
        return {**self.globals, **(d or {})}


def _special_token(config: Mapping[str, Any], name: str) -> str | None:
    value = config.get(name)
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else None


class ModelPrompts:
    """Tokenization and chat rendering of one model directory."""

    def __init__(self, model_dir: str | Path) -> None:
        directory = Path(model_dir)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{directory} has no tokenizer.json")
        self.directory = directory
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config_file = directory / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template_file = directory / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else self.config.get("chat_template")
        self._template = None
        if isinstance(template, str):
            env = _ChatEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.globals["raise_exception"] = _raise_exception
            env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
            self._template = env.from_string(template)
        self.bos_token = _special_token(self.config, "bos_token")
        self.eos_token = _special_token(self.config, "eos_token")
        eos_id = self.tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_id: int | None = eos_id

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast, not encode: it releases the GIL (so tokenizing a long prompt in a
        # thread does not stall the router's event loop: encode held it ~60 ms per 14k tokens)
        # and skips the character offsets, which halves the time. Same ids.
        encoded = self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return list(encoded[0].ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise PromptError(f"the model at {self.directory} has no chat template")
        normalized = _normalized(messages)
        try:
            return str(
                self._template.render(
                    messages=normalized,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token or "",
                    eos_token=self.eos_token or "",
                )
            )
        except TemplateError as exc:
            raise PromptError(f"the chat template rejected the messages: {exc}") from None

    def chat_tokens(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """A chat's prompt token ids, as vLLM's chat completions and /tokenize compute them."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _normalized(messages: Any) -> list[dict[str, Any]]:
    """Validated copies of the messages, text parts joined (as vLLM does for text-only models)."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty array")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise PromptError(f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):
            if not all(_is_text_part(p) for p in content):
                raise PromptError(f"messages[{i}].content parts must be text parts")
            content = "\n".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise PromptError(f"messages[{i}].content must be a string or an array of text parts")
        out.append({**message, "content": content})
    return out
