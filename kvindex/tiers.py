"""The cache tiers an engine reports (vLLM's ``medium``: GPU, CPU, disk, remote), in the order an
engine loads a prefix from them, and the index's holder of each tier of a worker.

A worker's GPU blocks are held by the worker itself; each lower tier's by a *tier holder*, a
registration of its own (``tier_holder(worker_id, tier)``, its record saying ``tier`` and
``tier_of``) with its own generation and pages, written by the same agent. So a match says how
deep each tier of each worker holds the prompt, exactly as it says it for the GPU (a per-tier
depth, counted from the prompt's first block), with no change to the layout or the scripts.
Routers never offer a tier holder as a worker: they read its depth beside its worker's.
"""

from __future__ import annotations

from typing import Final

GPU: Final = "GPU"
TIERS: Final = ("GPU", "CPU", "DISK", "REMOTE")  # the order an engine loads a prefix from
LOWER_TIERS: Final = TIERS[1:]
# What engines call them: vLLM's native offloading says "CPU"; LMCache and others name host
# memory, local disks and remote stores in their own words.
_MEDIA: Final = {
    "GPU": GPU,
    "CUDA": GPU,
    "DEVICE": GPU,
    "CPU": "CPU",
    "HOST": "CPU",
    "CPU_PINNED": "CPU",  # SGLang's host memory
    "DRAM": "CPU",
    "DISK": "DISK",
    "LOCALDISK": "DISK",
    "LOCAL_DISK": "DISK",
    "FS": "DISK",
    "STORAGE": "DISK",
    "NVME": "DISK",
    "SSD": "DISK",
    "REMOTE": "REMOTE",
    "OBJ": "REMOTE",
    "EXTERNAL": "REMOTE",  # SGLang's shared pool (Mooncake)
    "S3": "REMOTE",
}


def tier_of(medium: str | None) -> str | None:
    """The tier of an event's ``medium`` (none given: the GPU); None for one not known."""
    if medium is None:
        return GPU
    return _MEDIA.get(medium.strip().upper())


def tier_holder(worker_id: str, tier: str) -> str:
    """The id under which ``tier`` of ``worker_id`` holds blocks in the index."""
    return worker_id if tier == GPU else f"{worker_id}#{tier.lower()}"


def parse_tiers(text: str) -> frozenset[str]:
    """``GPU,CPU,...`` (any case, the media's other names too) -> tiers; a ValueError naming a word
    that is not one. The GPU is always in."""
    tiers = {GPU}
    for word in (w.strip() for w in text.split(",") if w.strip()):
        tier = tier_of(word)
        if tier is None:
            raise ValueError(f"unknown cache tier {word!r}: use {', '.join(TIERS)}")
        tiers.add(tier)
    return frozenset(tiers)
