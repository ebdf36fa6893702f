"""Tokenizing only what is new: a text's token ids from remembered pieces, equal to a full tokenization.

Multi-turn traffic resends the same text (a chat's earlier messages, a completion's earlier turns)
with a little more at the end, and tokenizing all of it again cost ~1 ms per 2k tokens. Here a
text is cut where the tokenizer itself would cut it, so that its token ids are the concatenation
of its pieces' ids, and each piece's ids are remembered (keyed by the piece's exact text):

1. At every added token (``<|im_start|>`` and the like, the chat template's separators): Hugging
   Face ``tokenizers`` extracts those first, by leftmost-longest match, and normalizes and
   pre-tokenizes each stretch of text between them on its own. Exact when every added token
   matches on the raw text (``normalized``, ``lstrip``, ``rstrip`` and ``single_word`` all off)
   and no step depends on where a stretch sits in the whole text (Metaspace's ``prepend_scheme``
   "first" does; such tokenizers get no memo).
2. Inside a long stretch, at a space that follows a non-space, the first such one at or after
   every ``chunk_chars`` characters: for the GPT-2 byte-level pre-tokenizer (``ByteLevel`` with
   its regex, no prefix space) no pre-token spans that point, because its regex takes a space
   only as a pre-token's first character, and no match before it looks past it (the one
   lookahead, ``\\s+(?!\\S)``, is inside runs of whitespace). BPE merges stay inside pre-tokens.
   Other pre-tokenizers are cut at added tokens only.

Cut points depend only on the text before them (plus the one space found), so a text that
extends another is cut the same way over their common part and only its new end is tokenized.
The special tokens that ``add_special_tokens`` adds around a text (BOS) are found by probing the
post-processor, and a tokenizer whose post-processor adds anything but fixed ids before and after
gets no memo. Golden tests: tests/unit/test_token_memo.py (vLLM's /tokenize captures, and random
texts against a full tokenization).
"""

from __future__ import annotations

import json
import re
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

CHUNK_CHARS = 256  # a stretch of text is cut about this often (~60 tokens of English)
DEFAULT_MAX_TOKENS = 1 << 21  # remembered token ids, in all (8 MiB of u32)
MAX_PIECES = 1 << 18  # remembered pieces, in all (words are pieces too: ~30 MB at most)
WORD_CUTS = re.compile(r"(?<=\S)(?= )")  # every space after a non-space: the same rule as a chunk's end
# Pre-tokenizers that treat each stretch between added tokens alike wherever it sits.
_POSITION_FREE = frozenset({"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit"})
_POST_PROCESSORS = frozenset({"TemplateProcessing", "ByteLevel", "Sequence"})
_NORMALIZERS = frozenset({"NFC"})  # a space never composes with what precedes it
Piece = str | int  # a stretch of text, or an added token's id


def _type(config: Any) -> str | None:
    return config.get("type") if isinstance(config, dict) else None


def _pre_tokenizers(config: Any) -> list[dict[str, Any]]:
    if _type(config) == "Sequence":
        return list(config.get("pretokenizers") or [])
    return [config] if config else []


def _cuts_at_spaces(config: Any) -> bool:
    """Whether the pre-tokenizer is GPT-2's byte-level regex alone (cut-at-a-space exact)."""
    steps = _pre_tokenizers(config)
    if len(steps) != 1 or _type(steps[0]) != "ByteLevel":
        return False
    return steps[0].get("use_regex", True) is True and steps[0].get("add_prefix_space") is False


def _stretches_independent(spec: dict[str, Any]) -> bool:
    if spec.get("truncation") or spec.get("padding"):
        return False
    normalizer = spec.get("normalizer")
    if normalizer is not None and _type(normalizer) not in _NORMALIZERS:
        return False
    steps = _pre_tokenizers(spec.get("pre_tokenizer"))
    if not all(_type(step) in _POSITION_FREE for step in steps):
        return False
    if any(_type(s) == "ByteLevel" and s.get("add_prefix_space") for s in steps):
        return False
    post = spec.get("post_processor")
    if post is not None and _type(post) not in _POST_PROCESSORS:
        return False
    flags = ("normalized", "lstrip", "rstrip", "single_word")
    return all(not any(token.get(flag) for flag in flags) for token in spec.get("added_tokens") or [])


def _affixes(tokenizer: Tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids ``add_special_tokens`` puts before and after any text, if that is all it does."""
    found = set()
    for probe in ("a", "hello world", "x\ny"):
        plain = tokenizer.encode(probe, add_special_tokens=False).ids
        full = tokenizer.encode(probe, add_special_tokens=True).ids
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
        if not plain or at is None:
            return None
        found.add((tuple(full[:at]), tuple(full[at + len(plain) :])))
    if len(found) != 1:
        return None
    before, after = found.pop()
    return list(before), list(after)


class TokenMemo:
    """Remembered token ids of text pieces of one tokenizer; LRU by total size. Not thread-safe:
    used on the event loop (only :meth:`encode_pieces`, which touches no state, runs in a thread)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        affixes: tuple[list[int], list[int]],
        cut_at_spaces: bool,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        chunk_chars: int = CHUNK_CHARS,
    ) -> None:
        self._tokenizer = tokenizer
        self._before, self._after = (array("I", ids).tobytes() for ids in affixes)
        self._packed: dict[int, bytes] = {}  # an added token's id, packed
        self._cut_at_spaces = cut_at_spaces
        self._chunk = chunk_chars
        self.max_tokens = max_tokens
        self.tokens = 0  # held now
        self.hits = 0  # pieces found remembered
        self.misses = 0  # pieces tokenized
        self._pieces: OrderedDict[str, bytes] = OrderedDict()  # text -> its ids as u32 (array's bytes)
        added = sorted(tokenizer.get_added_tokens_decoder().items(), key=lambda item: -len(item[1].content))
        self._added_ids = {token.content: token_id for token_id, token in added}
        # Longest first: at a position where several match, the longest wins (leftmost-longest).
        alternatives = "|".join(re.escape(token.content) for _, token in added)
        self._splitter = re.compile(f"({alternatives})") if added else None

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, **kwargs: Any) -> TokenMemo | None:
        """A memo for ``tokenizer``, or None when its tokenization cannot be cut exactly."""
        spec = json.loads(tokenizer.to_str())
        if not _stretches_independent(spec):
            return None
        affixes = _affixes(tokenizer)
        if affixes is None:
            return None
        return cls(tokenizer, affixes, _cuts_at_spaces(spec.get("pre_tokenizer")), **kwargs)

    def __len__(self) -> int:
        return len(self._pieces)

    def pieces(self, text: str) -> list[Piece]:
        """``text`` cut where the tokenizer cuts it: added tokens as ids, text stretches as strings."""
        stretches = self._splitter.split(text) if self._splitter is not None else [text]
        out: list[Piece] = []
        added = self._added_ids
        for i, stretch in enumerate(stretches):
            if i % 2:  # re.split puts the captured separators at odd positions
                out.append(added[stretch])
            elif stretch:
                out.extend(self._chunks(stretch) if self._cut_at_spaces else (stretch,))
        return out

    def _chunks(self, text: str) -> list[str]:
        chunks = []
        start = 0
        while len(text) - start > self._chunk:
            cut = text.find(" ", start + self._chunk)
            while cut != -1 and text[cut - 1].isspace():
                cut = text.find(" ", cut + 1)
            if cut == -1:
                break
            chunks.append(text[start:cut])
            start = cut
        chunks.append(text[start:])
        return chunks

    def missing(self, pieces: Sequence[Piece]) -> list[str]:
        """The texts to tokenize: the pieces not remembered (each once), or where a piece can be cut
        at its spaces, its words not remembered. New text is mostly known words, and a dictionary
        lookup a word costs less than the tokenizer's own pipeline (~2 us a word)."""
        return self.words_missing(self.new_pieces(pieces))

    def new_pieces(self, pieces: Sequence[Piece]) -> list[str]:
        """The text pieces not remembered, each once (counted as misses, the others as hits)."""
        known = self._pieces
        texts = [p for p in pieces if isinstance(p, str)]
        new = list(dict.fromkeys(p for p in texts if p not in known))
        self.misses += len(new)
        self.hits += len(texts) - len(new)
        return new

    def words_missing(self, new_pieces: Sequence[str]) -> list[str]:
        """What of ``new_pieces`` to tokenize when they are put together from their words: the
        words not remembered (the pieces themselves where a piece cannot be cut at its spaces)."""
        if not self._cut_at_spaces:
            return list(new_pieces)
        known = self._pieces
        words = (word for piece in new_pieces for word in WORD_CUTS.split(piece))
        return list(dict.fromkeys(word for word in words if word not in known))

    def encode_pieces(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids (no special tokens added); touches no state, so it may run in a thread."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def learn(self, texts: Sequence[str], ids: Sequence[Sequence[int]]) -> None:
        for text, token_ids in zip(texts, ids, strict=True):
            self._keep(text, array("I", token_ids).tobytes())

    def _keep(self, text: str, packed: bytes) -> None:
        if len(packed) > self.max_tokens or text in self._pieces:  # over a quarter of the budget: not kept
            return
        self._pieces[text] = packed
        self.tokens += len(packed) // 4
        while self.tokens > self.max_tokens or len(self._pieces) > MAX_PIECES:
            _, evicted = self._pieces.popitem(last=False)
            self.tokens -= len(evicted) // 4

    def assemble(
        self, pieces: Sequence[Piece], add_special_tokens: bool, fresh: Mapping[str, Sequence[int]] | None = None
    ) -> array:
        """The text's ids from its pieces, every text piece remembered or in ``fresh``: the pieces'
        packed ids joined in one C call (they are kept packed, as the block hashing reads them)."""
        known = self._pieces
        packed = self._packed
        parts = [self._before if add_special_tokens else b""]
        for piece in pieces:
            if isinstance(piece, int):
                parts.append(packed.get(piece) or packed.setdefault(piece, array("I", [piece]).tobytes()))
                continue
            found = known.get(piece)
            if found is not None:
                known.move_to_end(piece)
                parts.append(found)
                continue
            parts.append(self._new_piece(piece, fresh or {}))
        if add_special_tokens:
            parts.append(self._after)
        ids = array("I")
        ids.frombytes(b"".join(parts))
        return ids

    def remember(self, pieces: Sequence[str], fresh: Mapping[str, Sequence[int]]) -> None:
        """Put ``pieces`` (not remembered) together from their words, remembered or in ``fresh``,
        and keep them: what :meth:`assemble` would do for them, ahead of it."""
        for piece in pieces:
            if piece not in self._pieces:
                self._new_piece(piece, fresh)

    def _new_piece(self, piece: str, fresh: Mapping[str, Sequence[int]]) -> bytes:
        """A piece not remembered, from its words (remembered, or tokenized in ``fresh``), kept."""
        parts = []
        for word in WORD_CUTS.split(piece) if self._cut_at_spaces else (piece,):
            found = self._pieces.get(word)
            if found is None:
                given = fresh.get(word)  # None: evicted since missing() (rare), or no words
                found = array("I", given if given is not None else self.encode_pieces([word])[0]).tobytes()
            parts.append(found)
        packed = b"".join(parts)
        self._keep(piece, packed)
        return packed

    def encode(self, text: str, add_special_tokens: bool = True) -> array:
        """All in one (on the calling thread): what ``tokenizer.encode(text).ids`` gives."""
        pieces = self.pieces(text)
        missing = self.missing(pieces)
        fresh = dict(zip(missing, self.encode_pieces(missing), strict=True)) if missing else {}
        self.learn(missing, list(fresh.values()))
        return self.assemble(pieces, add_special_tokens, fresh)
