"""Block hashes as the 8-byte big-endian strings that block logs of the layout before pages hold
(gc reads them to collect a gid written by that layout: kvindex.collector)."""

from __future__ import annotations

import struct
from collections.abc import Sequence


def pack_hashes(hashes: Sequence[int]) -> bytes:
    try:
        return struct.pack(f">{len(hashes)}Q", *hashes)
    except struct.error as exc:
        raise ValueError(f"block hashes must be unsigned 64-bit integers: {exc}") from None


def unpack_hashes(blob: bytes) -> list[int]:
    if len(blob) % 8:
        raise ValueError(f"a hash blob needs 8 bytes per hash, got {len(blob)} bytes")
    return list(struct.unpack(f">{len(blob) // 8}Q", blob))
