"""What a writer must remember of one worker generation's writes, bucket by bucket, to send the
next one.

A write's page changes (kvindex.page_writes) go to the buckets of their segments. Calls into one
bucket are ordered by op ids that chain each call to the previous one (page_apply.lua): that is
how a writer learns that a bucket lost writes (a failover, a flush) and must be re-asserted.

Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvindex.page_writes import BucketPlan, SentPages


@dataclass
class GenerationWrites:
    """What a writer knows of one gid's entries, bucket by bucket."""

    gid: int
    ops: dict[int, int] = field(default_factory=dict)  # bucket -> id of the last call applied
    logs: dict[int, int] = field(default_factory=dict)  # bucket -> entries in the gid's page log
    entries: dict[int, int] = field(default_factory=dict)  # bucket -> the gid's indexed blocks
    claimed: set[int] = field(default_factory=set)  # buckets recorded for gc (claim.lua)
    key_delta: int = 0  # pages given a first holder minus emptied, not yet reported (tally.lua)
    sent: SentPages = field(default_factory=SentPages)  # the holdings stated, page by page

    def unclaimed(self, calls: Iterable[BucketPlan]) -> list[int]:
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

    def buckets_to_relog(self, slack: int, buckets: Iterable[int]) -> list[int]:
        """Of ``buckets`` (those a write just touched: only a write grows a log), those whose page
        log lists more than twice the pages the gid holds there, plus slack."""
        per_bucket = self.sent.per_bucket
        return [b for b in buckets if self.logs.get(b, 0) > 2 * per_bucket.get(b, 0) + slack]
