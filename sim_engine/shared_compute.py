"""Engines that share their compute: simulated engines on the same cores, as vLLM servers on a CPU.

vLLM's CPU servers on one machine share its cores; with vLLM's own binding (``auto``) every server
computes on the first core. While ``k`` engines run a step at once, each gets ``cores / k`` of the
compute, and its step takes that much longer (processor sharing): an idle engine is no faster than
a busy one, and four users at once see twice the latency one does (issue 55: closed-loop replies on
real vLLM took 2x the uncontended simulated engine's, and the routers that pick by load alone kept
4-6 points more hits there: a user's next turn found its last engine idle more often).

Engines started with the same directory (``--shared-compute``) share ``--shared-cores`` cores so:
each marks itself busy there (a file named by its process and engine) while it computes a step,
and computes the step in slices of at most ``SLICE_S``, each slice's progress its share of the
cores at that moment. A marker whose process is gone is removed by whoever sees it. Without a
directory an engine's step takes its time alone (a GPU of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from pathlib import Path

SLICE_S = 0.002  # how often a computing engine looks at how many others compute
_engines = itertools.count()  # engines of this process (the tests run several in one)


class SharedCompute:
    def __init__(self, directory: str | Path, cores: float) -> None:
        if cores <= 0:
            raise ValueError("the shared cores must be > 0")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.cores = cores
        self._marker = self.directory / f"{os.getpid()}.{next(_engines)}"

    def computing(self) -> int:
        """The engines computing a step now (this one counted when it is)."""
        count = 0
        for entry in os.scandir(self.directory):
            pid, _, _ = entry.name.partition(".")
            if pid.isdigit() and _alive(int(pid)):
                count += 1
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
        return count

    async def compute(self, seconds: float) -> None:
        """Take ``seconds`` of a core's compute, shared with the engines computing meanwhile."""
        if seconds <= 0:
            await asyncio.sleep(0)  # the engine's loop yields as a step of no time would
            return
        self._marker.touch()
        try:
            remaining = seconds
            while remaining > 1e-9:
                share = min(1.0, self.cores / max(self.computing(), 1))
                wall = min(remaining / share, SLICE_S)
                await asyncio.sleep(wall)
                remaining -= wall * share
        finally:
            self._marker.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
