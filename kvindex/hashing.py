"""Block hashing: the one function every part of kvroute uses to name a KV block.

The rule (documented with test vectors in docs/hashing.md):

* A prompt is cut into blocks of ``block_size`` token ids; a partial tail block is never hashed,
  because engines never cache (or announce) one.
* local_i = XXH3-64(seed 1337) over the block's token ids as u32 little-endian.
* seq_0 = local_0, seq_i = XXH3-64(seed 1337) over u64-LE(seq_{i-1}) || u64-LE(local_i).
  This is NVIDIA Dynamo's rule, so with no identity the values are Dynamo-compatible.
* Identity that must separate caches (a LoRA adapter, a tenant's ``cache_salt``) enters the first
  block only: seq_0 = XXH3-64(seed 1337) over u64-LE(local_0) || identity_tag. Every later hash
  chains from seq_0, so two identities never share any key.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import xxhash

HASH_SEED = 1337
MAX_TOKEN_ID = 0xFFFFFFFF
_IDENTITY_MAGIC = b"kvroute:identity:v1"
_U64_PAIR = struct.Struct("<QQ")
_U64 = struct.Struct("<Q")


def identity_tag(lora_name: str | None = None, cache_salt: str | None = None) -> bytes | None:
    """Bytes that separate caches, or None when the request has no LoRA and no salt.

    Length-prefixed so that ("ab", "c") and ("a", "bc") never collide.
    """
    if not lora_name and not cache_salt:
        return None
    parts = [_IDENTITY_MAGIC]
    for value in (lora_name or "", cache_salt or ""):
        encoded = value.encode("utf-8")
        parts.append(struct.pack("<I", len(encoded)))
        parts.append(encoded)
    return b"".join(parts)


def token_bytes(tokens: Sequence[int] | array) -> bytes:
    """The token ids as u32 little-endian bytes; ValueError names a bad id."""
    if isinstance(tokens, array) and tokens.typecode == "I" and sys.byteorder == "little":
        return tokens.tobytes()  # already checked when it was built
    try:
        packed = array("I", tokens)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in 0..{MAX_TOKEN_ID}: {exc}") from None
    except TypeError as exc:
        raise ValueError(f"token ids must be integers: {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - no mainstream platform has a 2- or 8-byte uint
        raise RuntimeError("array('I') is not 32-bit on this platform")
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def block_local_hashes(tokens: Sequence[int] | array, block_size: int) -> list[int]:
    """XXH3-64 of each full block of ``tokens``; the partial tail block is dropped."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return local_hashes_of_bytes(token_bytes(tokens), block_size)


def local_hashes_of_bytes(data: bytes, block_size: int) -> list[int]:
    """:func:`block_local_hashes` of tokens already packed by :func:`token_bytes`."""
    stride = 4 * block_size
    full = len(data) // stride
    digest = xxhash.xxh3_64_intdigest
    return [digest(data[i * stride : (i + 1) * stride], seed=HASH_SEED) for i in range(full)]


def chain_hashes(local_hashes: Sequence[int], identity: bytes | None = None, parent: int | None = None) -> list[int]:
    """Turn per-block local hashes into chained sequence hashes (see the module docstring).

    ``parent`` continues an existing chain (its identity is already folded in); without it the
    first local hash is block 0 and ``identity`` applies to it.
    """
    digest = xxhash.xxh3_64_intdigest
    pack_pair = _U64_PAIR.pack
    out: list[int] = []
    previous = parent
    for local in local_hashes:
        if previous is not None:
            current = digest(pack_pair(previous, local), seed=HASH_SEED)
        elif identity is None:
            current = local
        else:
            current = digest(_U64.pack(local) + identity, seed=HASH_SEED)
        out.append(current)
        previous = current
    return out


def sequence_hashes(
    tokens: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """The chained hash of every full block of a prompt: what the index is keyed by."""
    return chain_hashes(block_local_hashes(tokens, block_size), identity_tag(lora_name, cache_salt))


def extend_sequence_hashes(
    parent: int | None,
    tokens: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """Hashes of blocks that continue a chain whose last block hash is ``parent``.

    With ``parent`` None the tokens start at block 0 and the identity applies; otherwise the
    identity is already folded into ``parent``. Used to hash an engine's stored run.
    """
    identity = identity_tag(lora_name, cache_salt) if parent is None else None
    return chain_hashes(block_local_hashes(tokens, block_size), identity, parent)
