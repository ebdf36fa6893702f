"""Token-id prompts decoded only where they are new.

Clients that tokenize themselves (a model server's own front end, an agent framework, a
pre-processor in front of the router) send the same long prefix as the same JSON text again and
again: a document, a system prompt, a conversation so far. Decoding an 8k-id list cost msgspec
~170 us (one Python int per id) and packing it into u32 another ~60 us: the largest share of such
a request's router CPU (docs/benchmarks-history.md, issue 15). So the JSON text of a flat id list is cut
at the first comma past every ``chunk_bytes``, and the ids of each piece are remembered under a
128-bit digest of the text from the list's start to the piece's end. A prompt whose text starts
as one seen before takes those ids from the memo and decodes only the rest.

Exact: equal text up to a cut means equal ids before it (a top-level comma of a flat list ends a
whole number), and every remembered piece was decoded by msgspec and packed by ``array('I')``,
which checked each id. A text the memo cannot read as plain u32 ids is left to the ordinary
decoder (:mod:`router.prompts.body`), which gives its usual errors.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

import xxhash

CHUNK_BYTES = 2048  # ~350 ids of 5 digits; a cut's digest and lookup cost ~1 us
DEFAULT_MAX_IDS = 4 << 20  # 16 MB of remembered ids


class TokenIdMemo:
    """An LRU of pieces of id lists by the digest of their text so far; one per router, used on
    the event loop (not thread-safe). A prompt's pieces are used root last, so that the memo
    forgets a prefix from its end: a piece is of use only while every piece before it is kept."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, max_ids: int = DEFAULT_MAX_IDS) -> None:
        if chunk_bytes < 1 or max_ids < 1:
            raise ValueError("chunk_bytes and max_ids must be positive")
        self.chunk_bytes = chunk_bytes
        self._max_ids = max_ids
        self._pieces: OrderedDict[int, array] = OrderedDict()
        self._held = 0  # ids in the memo
        self.hits = 0  # ids taken from the memo
        self.misses = 0  # ids decoded

    def __len__(self) -> int:
        return len(self._pieces)

    def cuts(self, raw: bytes) -> list[int]:
        """Where ``raw`` (a JSON array's text, ``[`` first) is cut: the first comma at or past
        every multiple of ``chunk_bytes``, each once; the text after the last cut is never a key."""
        cuts: list[int] = []
        at = self.chunk_bytes
        while True:
            comma = raw.find(b",", at)
            if comma == -1:
                return cuts
            cuts.append(comma)
            at = max(comma + 1, at + self.chunk_bytes)

    def known_prefix(self, raw: bytes, cuts: list[int]) -> tuple[array, int, list[int]]:
        """The ids before the last cut whose text is remembered (empty when none), how many
        pieces they are, and the digests of the text up to each cut."""
        text = memoryview(raw)
        digest = xxhash.xxh3_128()
        keys: list[int] = []
        start = 0
        for cut in cuts:
            digest.update(text[start:cut])
            keys.append(digest.intdigest())
            start = cut
        ids = array("I")
        known = 0
        for key in keys:
            piece = self._pieces.get(key)
            if piece is None:
                break
            ids.extend(piece)
            known += 1
        self.hits += len(ids)
        return ids, known, keys

    def remember(self, raw: bytes, cuts: list[int], keys: list[int], ids: array, known: int, known_ids: int) -> None:
        """Remembers the pieces of ``ids`` (all of ``raw``'s) between the cuts after the first
        ``known``, whose pieces (``known_ids`` ids) the memo gave."""
        self.misses += len(ids) - known_ids
        begin = known_ids  # the ids before a cut: the commas before it, plus one
        commas, position = (known_ids - 1, cuts[known - 1]) if known else (0, 0)
        for cut, key in zip(cuts[known:], keys[known:], strict=True):
            commas += raw.count(b",", position, cut)
            piece = ids[begin : commas + 1]
            if key not in self._pieces:
                self._held += len(piece)
            self._pieces[key] = piece
            begin, position = commas + 1, cut
        for key in reversed(keys):  # the root most recent: the deepest pieces are forgotten first
            self._pieces.move_to_end(key)
        while self._held > self._max_ids and self._pieces:
            self._held -= len(self._pieces.popitem(last=False)[1])
