"""kvindex: the shared KV-block index that routers read and worker agents write.

It imports neither ``router`` nor ``worker_agent``; both import it.
"""

from kvindex.hashing import sequence_hashes
from kvindex.interface import KVIndex
from kvindex.keys import KeySchema
from kvindex.types import StoredRun, WorkerInfo

__all__ = ["KVIndex", "KeySchema", "StoredRun", "WorkerInfo", "sequence_hashes"]
