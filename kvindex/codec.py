"""Packs index operations into the compact binary arguments the Lua scripts expect.

Every block key a script touches is declared in its KEYS (Redis Cluster requires it); the hashes
of added blocks also travel as 8 bytes big-endian (one string per segment), which apply.lua
appends to the gid's block log.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from kvindex.mirror import IndexAdd, IndexOp


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
    parents: list[int]  # the explicit parents ('p' flags), in order


def encode_adds(adds: Sequence[IndexAdd]) -> StoreArgs:
    """Encode additions for an apply.lua segment: flag 'r' (chain start), 'c' (parent is the
    previous item) or 'p' (parent given explicitly: its key follows the items' keys)."""
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
    return StoreArgs(pack_hashes(hashes), bytes(flags), parents)


def encode_ops(ops: Sequence[IndexOp]) -> tuple[bytes, list[int], list[bytes | int]]:
    """Encode an ordered mix of additions and subtractions in one bucket for apply.lua: the
    segment kinds ('a'/'s', one per run of same-kind operations), the blocks whose keys the
    segments touch (declared in KEYS, in the script's order: see :class:`KeyRun`) and each
    segment's arguments in order."""
    kinds = bytearray()
    keys: list[int] = []
    args: list[bytes | int] = []
    start = 0
    for end in range(1, len(ops) + 1):
        if end < len(ops) and type(ops[end]) is type(ops[start]):
            continue
        segment = ops[start:end]
        if isinstance(segment[0], IndexAdd):
            kinds += b"a"
            encoded = encode_adds(segment)  # type: ignore[arg-type]
            keys += [op.block for op in segment]
            keys += encoded.parents
            args += [encoded.hashes, encoded.flags]
        else:
            kinds += b"s"
            keys += [op.block for op in segment]
            args.append(len(segment))
        start = end
    return bytes(kinds), keys, args


class KeyRun(Sequence[str]):
    """Script keys: a few ``lead`` keys, then keys made of one prefix and 16 hex digits each (a
    chain's or a bucket's block keys), kept as the packed hashes: a script call declares them
    all, and :meth:`resp` encodes them for the wire in one pass (redis-py's encoder takes ~0.6 us
    per argument: 300 us for an 8k-token prompt's keys, 10 ms for a 16k-operation apply call)."""

    __slots__ = ("_hashes", "lead", "prefix")

    def __init__(self, prefix: str, hashes: Sequence[int] | bytes, lead: Sequence[str] = ()) -> None:
        self.prefix = prefix
        self.lead = tuple(lead)
        self._hashes = hashes if isinstance(hashes, bytes) else pack_hashes(hashes)

    def __len__(self) -> int:
        return len(self.lead) + len(self._hashes) // 8

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        keys = [*self.lead, *(f"{self.prefix}{h:016x}" for h in unpack_hashes(self._hashes))]
        return keys[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self[:])

    def resp(self) -> bytes:
        """The keys as RESP bulk strings, back to back."""
        lead = b"".join(b"$%d\r\n%s\r\n" % (len(k.encode()), k.encode()) for k in self.lead)
        if not self._hashes:
            return lead
        head = f"${len(self.prefix.encode()) + 16}\r\n{self.prefix}"
        return lead + (head + self._hashes.hex(":", 8).replace(":", "\r\n" + head) + "\r\n").encode()
