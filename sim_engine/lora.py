"""The LoRA adapters a simulated engine serves, as vLLM keeps them: started with
``--lora-modules NAME=PATH ...``, loaded and unloaded at run time through ``/v1/load_lora_adapter``
and ``/v1/unload_lora_adapter`` (with ``--enable-lora``; vLLM also needs
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), listed by ``/v1/models`` each with its base model as
``parent``, and named by a request's ``model``. Each gets a number from 1 in load order, vLLM's
``lora_id`` in the KV events. An adapter changes no timing here; its blocks are cached apart from
the base model's (its name is every block's first extra key: sim_engine.block_pool.CacheKeys).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: str
    lora_id: int


class LoraError(ValueError):
    """A load or unload vLLM refuses: ``status`` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_module(text: str) -> tuple[str, str]:
    """``NAME=PATH`` (vLLM's --lora-modules form) -> (name, path); a ValueError saying what is wrong."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules takes NAME=PATH, got {text!r}")
    if "\n" in name:
        raise ValueError(f"a LoRA adapter's name must be one line, got {name!r}")
    return name.strip(), path.strip()


class LoraAdapters:
    """The adapters served now, by name."""

    def __init__(self, modules: Sequence[tuple[str, str]] = ()) -> None:
        self._by_name: dict[str, LoraAdapter] = {}
        self._next_id = 1
        for name, path in modules:
            self.load(name, path)

    def __iter__(self) -> Iterator[LoraAdapter]:
        return iter(sorted(self._by_name.values(), key=lambda a: a.lora_id))

    def get(self, name: str) -> LoraAdapter | None:
        return self._by_name.get(name)

    def load(self, name: str, path: str) -> LoraAdapter:
        if not name or not path or "\n" in name:
            raise LoraError(400, "lora_name and lora_path must be non-empty strings (the name on one line)")
        if name in self._by_name:
            raise LoraError(400, f"The lora adapter '{name}' has already been loaded.")
        adapter = self._by_name[name] = LoraAdapter(name, path, self._next_id)
        self._next_id += 1
        return adapter

    def unload(self, name: str) -> None:
        if self._by_name.pop(name, None) is None:
            raise LoraError(404, f"The lora adapter '{name}' cannot be found.")
