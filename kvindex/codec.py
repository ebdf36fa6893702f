"""Packs index operations into the compact binary arguments the Lua scripts expect.

Block hashes travel as 8 bytes big-endian (one string for a whole batch, so a call costs a
handful of Redis arguments whatever its size); scripts turn the few they touch into hex keys.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvindex.mirror import IndexAdd, IndexOp, IndexSub


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
    parents: bytes


def encode_adds(adds: Sequence[IndexAdd]) -> StoreArgs:
    """Encode additions for an apply.lua segment: flag 'r' (chain start), 'c' (parent is the
    previous item) or 'p' (parent given explicitly, in ``parents``)."""
    hashes: list[int] = []
    flags = bytearray()
    parents: list[int] = []
    previous: int | None = None
    for add in adds:
        if add.parent is None:
            flags += b"r"
        elif add.parent == previous:
            flags += b"c"
        else:
            flags += b"p"
            parents.append(add.parent)
        hashes.append(add.block)
        previous = add.block
    return StoreArgs(pack_hashes(hashes), bytes(flags), pack_hashes(parents))


def encode_subs(subs: Sequence[IndexSub]) -> bytes:
    """Encode subtractions for an apply.lua segment: the hashes."""
    return pack_hashes([sub.block for sub in subs])


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
            args += [encoded.hashes, encoded.flags, encoded.parents]
        else:
            kinds += b"s"
            args.append(encode_subs(segment))  # type: ignore[arg-type]
        start = end
    return bytes(kinds), args
