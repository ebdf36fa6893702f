"""A worker's own view of its cached blocks, and the index updates that keep Redis prefix-closed.

The writer of a worker (its agent) keeps this mirror. It knows every block the engine holds, how
many copies, and each block's parent. The shared index only lists a worker's *indexed* blocks:
held blocks whose whole chain of ancestors is held too. A block whose ancestor is gone can never
be a prefix hit, so leaving it out changes no match result, and it keeps each worker's entries
prefix-closed, so that the index holds nothing a match could use only partly.

Copies are counted here, not in Redis: the index records whether a worker holds a block, so a
block is added when it becomes indexed and taken out when it stops being indexed (its last copy
goes, or an ancestor does); a second copy of an indexed block, or the removal of one of two
copies, is no index operation at all.

A limit (the engine's cache size, see RedisWorker) caps the indexed blocks: a store that would
index more is held but not indexed, and counted in ``over_limit``. An engine never holds more
blocks than its cache has, so only a runaway mirror (lost removal events, a buggy engine) meets
it, and one worker can then not grow the shared index past its own capacity.

Pure data structure, no I/O: it turns stores and removals into ordered index operations.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from itertools import pairwise, repeat
from typing import NamedTuple

from kvindex.types import BlockChange, RemovedBlocks, StoredRun, WriteResult


class IndexAdd(NamedTuple):
    """Add ``block`` to the worker's indexed blocks; ``parent`` is indexed already (or None).
    ``root`` is the first block of its chain (the block itself when it has no parent). (A tuple:
    a writer makes one per block it stores.)"""

    block: int
    parent: int | None
    root: int


class IndexSub(NamedTuple):
    """Take ``block`` (of the chain starting at ``root``) out of the worker's indexed blocks."""

    block: int
    root: int


IndexOp = IndexAdd | IndexSub
_index_add = partial(tuple.__new__, IndexAdd)  # IndexAdd from a (block, parent, root) tuple, at C speed


class BlockMirror:
    """Reference-counted blocks of one worker with their parent links."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit  # most blocks indexed at once (None: no limit)
        self.over_limit = 0  # stored blocks left out of the index because of the limit
        self._capped: set[int] = set()  # held blocks the limit left out (their chain was indexed)
        self._copies: dict[int, int] = {}
        self._parent: dict[int, int | None] = {}
        self._children: dict[int, set[int]] = {}
        self._indexed: set[int] = set()
        self._root: dict[int, int] = {}  # indexed block -> its chain's first block
        self.held = 0  # physical blocks with a hash: every copy counted
        # The most physical blocks held when the engine evicted one (None: it never has). An
        # engine evicts a cached block only once no never-used block is left, so this is its
        # cache's size, less the null block and the blocks in use that were not full yet then
        # (see inferred_capacity).
        self.eviction_peak: int | None = None

    def __len__(self) -> int:
        return len(self._copies)

    @property
    def indexed_count(self) -> int:
        return len(self._indexed)

    def copies(self, block: int) -> int:
        return self._copies.get(block, 0)

    def is_indexed(self, block: int) -> bool:
        return block in self._indexed

    def apply(self, changes: Iterable[BlockChange]) -> tuple[list[IndexOp], WriteResult]:
        """Record stores and removals in order; returns the index operations in the order they
        must be applied, and what happened (stored blocks not indexable count as skipped)."""
        ops: list[IndexOp] = []
        result = WriteResult()
        for change in changes:
            if isinstance(change, RemovedBlocks):
                subs, missing = self.remove(change.hashes)
                ops.extend(subs)
                result += WriteResult(applied=len(change.hashes) - missing, missing=missing)
            else:
                adds, orphaned = self.store([change])
                ops.extend(adds)
                result += WriteResult(applied=len(change.hashes) - orphaned, skipped=orphaned)
        return ops, result

    def store(self, runs: Iterable[StoredRun]) -> tuple[list[IndexAdd], int]:
        """Record stored runs; returns the index additions (parents first) and how many stored
        blocks could not be indexed (an ancestor is not held, or the limit is reached)."""
        adds: list[IndexAdd] = []
        orphaned = 0
        for run in runs:
            if self._store_new_run(run, adds):
                continue
            parent = run.parent
            for block in run.hashes:
                if not self._store_one(block, parent, adds):
                    orphaned += 1
                parent = block
        return adds, orphaned

    def remove(self, blocks: Sequence[int]) -> tuple[list[IndexSub], int]:
        """Drop one copy of each block; returns the index subtractions (descendants before their
        ancestors) and how many blocks were not held at all."""
        subs: list[IndexSub] = []
        missing = 0
        if blocks:
            self.eviction_peak = max(self.eviction_peak or 0, self.held)
        for block in blocks:
            copies = self._copies.get(block)
            if copies is None:
                missing += 1
            elif copies > 1:
                self._copies[block] = copies - 1
                self.held -= 1
            else:
                self._drop(block, subs)
                self.held -= 1
        return subs, missing

    def inferred_capacity(self) -> int | None:
        """The engine's cache size in blocks as its evictions show it, for an engine that does not
        report it (no ``vllm:cache_config_info``): the most blocks held at an eviction, plus vLLM's
        null block. A lower bound, short by the blocks in use that were not full yet at that
        eviction, so it reaches the size at the first eviction made with none (chunked prefill
        makes them common: a request that evicts mid-prefill fills whole blocks); None before any
        eviction (the cache has had room all along). Not a partly filled block per request running
        when it is read: those were not the ones at the eviction, and under load that overstated
        the size by up to the running count (docs/benchmarks-history.md, issue 37)."""
        if self.eviction_peak is None:
            return None
        return self.eviction_peak + 1

    def clear(self) -> None:
        """Forget every block (the engine's cache was cleared); its size, as evictions showed it, stays."""
        self.held = 0
        self._capped.clear()
        self._copies.clear()
        self._parent.clear()
        self._children.clear()
        self._indexed.clear()
        self._root.clear()

    def indexed_in_order(self) -> list[IndexAdd]:
        """Every indexed block, each parent before its children."""
        out: list[IndexAdd] = []
        stack = [b for b in self._indexed if self._parent[b] is None]
        while stack:
            block = stack.pop()
            out.append(IndexAdd(block, self._parent[block], self._root[block]))
            stack.extend(c for c in self._children.get(block, ()) if c in self._indexed)
        return out

    def _store_new_run(self, run: StoredRun, adds: list[IndexAdd]) -> bool:
        """The common store at once: a run of blocks none of which is held or has a child held,
        under an indexed parent (or none), within the limit; False (nothing done) otherwise,
        for :meth:`_store_one` block by block. An agent stores mostly such runs: a prompt's
        new blocks after its cached prefix."""
        hashes, parent = run.hashes, run.parent
        if not hashes or (parent is not None and parent not in self._indexed):
            return False
        if self.limit is not None and len(self._indexed) + len(hashes) > self.limit:
            return False
        if not self._copies.keys().isdisjoint(hashes) or not self._children.keys().isdisjoint(hashes):
            return False
        if len(set(hashes)) != len(hashes):
            return False  # a block twice in one run: its copies are counted one by one
        parents = (parent, *hashes[:-1])
        root = hashes[0] if parent is None else self._root[parent]
        self.held += len(hashes)
        self._copies.update(dict.fromkeys(hashes, 1))
        self._parent.update(zip(hashes, parents, strict=True))
        if parent is not None:
            self._children.setdefault(parent, set()).add(hashes[0])
        self._children.update({above: {below} for above, below in pairwise(hashes)})
        self._indexed.update(hashes)
        self._root.update(dict.fromkeys(hashes, root))
        adds.extend(map(_index_add, zip(hashes, parents, repeat(root, len(hashes)), strict=True)))
        return True

    def _store_one(self, block: int, parent: int | None, adds: list[IndexAdd]) -> bool:
        self.held += 1
        copies = self._copies.get(block)
        if copies is not None:
            # Parent links come from the first store; chained hashes make later ones equal.
            self._copies[block] = copies + 1
            if block in self._indexed:
                return True
            parent = self._parent[block]  # held but not indexed: its ancestor, or the limit
        else:
            self._copies[block] = 1
            self._parent[block] = parent
            if parent is not None:
                self._children.setdefault(parent, set()).add(block)
        if (parent is not None and parent in self._capped) or (
            (parent is None or parent in self._indexed) and self._full()
        ):
            self._capped.add(block)
            self.over_limit += 1
            return False
        if parent is not None and parent not in self._indexed:
            return False
        if block not in self._children:  # the common case: a new block with nothing below it
            root = block if parent is None else self._root[parent]
            self._indexed.add(block)
            self._root[block] = root
            self._capped.discard(block)
            adds.append(IndexAdd(block, parent, root))
            return True
        self._collect_subtree(block, adds)
        return True

    def _full(self) -> bool:
        return self.limit is not None and len(self._indexed) >= self.limit

    def _collect_subtree(self, root: int, out: list[IndexAdd]) -> None:
        """Index ``root`` and every held, not yet indexed descendant, parents first, while the
        limit allows (descendants left out stay held and join when they are stored again)."""
        stack = [root]
        while stack and not self._full():
            block = stack.pop()
            parent = self._parent[block]
            root = block if parent is None else self._root[parent]
            self._indexed.add(block)
            self._root[block] = root
            self._capped.discard(block)
            out.append(IndexAdd(block, parent, root))
            stack.extend(c for c in self._children.get(block, ()) if c not in self._indexed)
        self._capped.update(stack)

    def _drop(self, block: int, subs: list[IndexSub]) -> None:
        self._capped.discard(block)
        if block in self._indexed:
            self._unindex_descendants(block, subs)
            self._indexed.discard(block)
            subs.append(IndexSub(block, self._root.pop(block)))
        del self._copies[block]
        parent = self._parent.pop(block)
        if parent is not None:
            siblings = self._children[parent]
            siblings.discard(block)
            if not siblings:
                del self._children[parent]

    def _unindex_descendants(self, block: int, subs: list[IndexSub]) -> None:
        """Un-index the indexed descendants of ``block``, deepest first; they stay held and
        return to the index when ``block`` is stored again."""
        order: list[int] = []
        stack = [c for c in self._children.get(block, ()) if c in self._indexed]
        while stack:
            child = stack.pop()
            order.append(child)
            stack.extend(c for c in self._children.get(child, ()) if c in self._indexed)
        for child in reversed(order):
            self._indexed.discard(child)
            subs.append(IndexSub(child, self._root.pop(child)))
