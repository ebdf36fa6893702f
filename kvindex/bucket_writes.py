"""One worker generation's writes into its buckets: how index operations become apply.lua calls,
and what the writer must remember per bucket to send the next one.

A bucket holds whole chains (kvindex.keys), so a prompt's match reads one bucket; an engine
batch's operations in one bucket travel in one apply.lua call, so a match never sees half of a
batch. Calls of different buckets are independent (on a cluster, on different shards); calls of
one bucket are ordered by op ids that chain each call to the previous one (apply.lua), which is
how a writer learns that a bucket lost writes (a failover, a flush) and must be re-asserted.

Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvindex.keys import bucket_of
from kvindex.mirror import IndexOp


@dataclass(frozen=True)
class BucketCall:
    """One apply.lua call: ``ops`` in ``bucket``, in order."""

    bucket: int
    ops: tuple[IndexOp, ...]


def bucket_of_op(op: IndexOp) -> int:
    return bucket_of(op.root)


def plan_calls(batches: Iterable[Sequence[IndexOp]], max_items: int) -> tuple[list[BucketCall], int]:
    """Each batch's operations grouped by bucket, consecutive batches sharing a bucket's call up
    to ``max_items`` operations. Returns the calls (a bucket's calls in order) and how many
    batches had more than ``max_items`` operations in one bucket and were split."""
    calls: list[BucketCall] = []
    pending: dict[int, list[IndexOp]] = {}
    split = 0
    for batch in batches:
        by_bucket: dict[int, list[IndexOp]] = {}
        for op in batch:
            by_bucket.setdefault(bucket_of_op(op), []).append(op)
        for bucket, ops in by_bucket.items():
            current = pending.setdefault(bucket, [])
            if current and len(current) + len(ops) > max_items:
                calls.append(BucketCall(bucket, tuple(current)))
                current.clear()
            if len(ops) > max_items:
                split += 1
                pieces = [ops[i : i + max_items] for i in range(0, len(ops), max_items)]
                calls.extend(BucketCall(bucket, tuple(piece)) for piece in pieces[:-1])
                ops = pieces[-1]
            current.extend(ops)
    calls.extend(BucketCall(bucket, tuple(ops)) for bucket, ops in pending.items() if ops)
    return calls, split


def waves(calls: Sequence[BucketCall]) -> list[list[BucketCall]]:
    """The calls in rounds that may run concurrently: round k holds each bucket's k-th call."""
    rounds: list[list[BucketCall]] = []
    seen: dict[int, int] = {}
    for call in calls:
        k = seen.get(call.bucket, 0)
        seen[call.bucket] = k + 1
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(call)
    return rounds


@dataclass
class GenerationWrites:
    """What a writer knows of one gid's entries, bucket by bucket."""

    gid: int
    ops: dict[int, int] = field(default_factory=dict)  # bucket -> id of the last call applied
    logs: dict[int, int] = field(default_factory=dict)  # bucket -> entries in the gid's block log
    entries: dict[int, int] = field(default_factory=dict)  # bucket -> the gid's entries
    claimed: set[int] = field(default_factory=set)  # buckets recorded for gc (claim.lua)
    key_delta: int = 0  # block keys created minus emptied, not yet reported (heartbeat.lua)

    def unclaimed(self, calls: Iterable[BucketCall]) -> list[int]:
        return sorted({call.bucket for call in calls} - self.claimed)

    def next_op(self, bucket: int) -> tuple[int, int]:
        """(previous op id, op id) for the next call into ``bucket``."""
        previous = self.ops.get(bucket, 0)
        return previous, previous + 1

    def applied(self, bucket: int, op: int, log_entries: int, entries: int, key_delta: int) -> None:
        self.ops[bucket] = op
        self.logs[bucket] = log_entries
        self.entries[bucket] = entries
        self.key_delta += key_delta

    def buckets_to_relog(self, slack: int) -> list[int]:
        """Buckets whose block log lists more than twice the gid's entries there, plus slack."""
        return [b for b, n in self.logs.items() if n > 2 * self.entries.get(b, 0) + slack]
