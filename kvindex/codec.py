"""Packs index operations into the compact binary arguments the Lua scripts expect.

Block hashes travel as 8 bytes big-endian (one string for a whole batch, so a call costs a
handful of Redis arguments whatever its size); scripts turn the few they touch into hex keys.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvindex.mirror import IndexAdd, IndexOp, IndexSub

MAX_COUNT_PER_ITEM = 0xFFFF


def pack_hashes(hashes: Sequence[int]) -> bytes:
    try:
        return struct.pack(f">{len(hashes)}Q", *hashes)
    except struct.error as exc:
        raise ValueError(f"block hashes must be unsigned 64-bit integers: {exc}") from None


def unpack_hashes(blob: bytes) -> list[int]:
    if len(blob) % 8:
        raise ValueError(f"a hash blob needs 8 bytes per hash, got {len(blob)} bytes")
    return list(struct.unpack(f">{len(blob) // 8}Q", blob))


@dataclass(frozen=True)
class StoreArgs:
    hashes: bytes
    flags: bytes
    counts: bytes
    parents: bytes


def encode_adds(adds: Sequence[IndexAdd]) -> StoreArgs:
    """Encode additions for an apply.lua segment: flag 'r' (chain start), 'c' (parent is the previous item)
    or 'p' (parent given explicitly). Counts above 65535 are split into several items."""
    hashes: list[int] = []
    flags = bytearray()
    counts: list[int] = []
    parents: list[int] = []
    previous: int | None = None
    for add in adds:
        remaining = add.count
        while remaining > 0:
            chunk = min(remaining, MAX_COUNT_PER_ITEM)
            if add.parent is None:
                flags += b"r"
            elif add.parent == previous and remaining == add.count:
                flags += b"c"
            else:
                flags += b"p"
                parents.append(add.parent)
            hashes.append(add.block)
            counts.append(chunk)
            remaining -= chunk
        previous = add.block
    return StoreArgs(pack_hashes(hashes), bytes(flags), struct.pack(f">{len(counts)}H", *counts), pack_hashes(parents))


def encode_subs(subs: Sequence[IndexSub]) -> tuple[bytes, bytes]:
    """Encode subtractions for an apply.lua segment: the hashes and their 2-byte counts."""
    hashes: list[int] = []
    counts: list[int] = []
    for sub in subs:
        remaining = sub.count
        while remaining > 0:
            chunk = min(remaining, MAX_COUNT_PER_ITEM)
            hashes.append(sub.block)
            counts.append(chunk)
            remaining -= chunk
    return pack_hashes(hashes), struct.pack(f">{len(counts)}H", *counts)


def encode_ops(ops: Sequence[IndexOp]) -> tuple[bytes, list[bytes]]:
    """Encode an ordered mix of additions and subtractions for apply.lua: the segment kinds
    ('a'/'s', one per run of same-kind operations) and each segment's arguments in order."""
    kinds = bytearray()
    args: list[bytes] = []
    start = 0
    for end in range(1, len(ops) + 1):
        if end < len(ops) and type(ops[end]) is type(ops[start]):
            continue
        segment = ops[start:end]
        if isinstance(segment[0], IndexAdd):
            kinds += b"a"
            encoded = encode_adds(segment)  # type: ignore[arg-type]
            args += [encoded.hashes, encoded.flags, encoded.counts, encoded.parents]
        else:
            kinds += b"s"
            args += list(encode_subs(segment))  # type: ignore[arg-type]
        start = end
    return bytes(kinds), args
