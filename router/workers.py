"""``kvroute router --workers N``: N router processes on one port, so that one host uses its cores.

One Python process routes on one core (~2-3k short requests/s). Each of the N processes forked
here is a complete replica: its own event loop, Redis connections, tokenizer memo and in-flight
bookings under its own replica id (``--replica-id`` suffixed ``-w0``, ``-w1``, ...). They share
nothing but Redis, exactly like replicas on different hosts, so the shared load each one books
and reads stays correct (each renews its own lease; a dead one's bookings expire with it). Every
process listens on the same address with ``SO_REUSEPORT``: the kernel spreads new connections
over them.

The parent only supervises: SIGTERM or SIGINT is passed on to every process, which drains as a
single router does; when one process exits on its own (a bind error, a crash) the others are
stopped and the parent exits with that process's status, for the service manager to restart the
whole set. A process whose parent dies is sent SIGTERM (Linux ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from types import FrameType

from router.settings import RouterSettings

log = logging.getLogger("router")
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # a libc without prctl: no such guard
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def worker_settings(settings: RouterSettings, number: int) -> RouterSettings:
    """Process ``number``'s settings: one process, the shared port, a replica id of its own."""
    return replace(settings, workers=1, reuse_port=True, replica_id=f"{settings.replica_id}-w{number}")


def run_workers(settings: RouterSettings, serve: Callable[[RouterSettings], int]) -> int:
    """Fork ``settings.workers`` processes, each running ``serve`` with its settings; wait for them."""
    children: dict[int, int] = {}  # pid -> worker number
    stopping = False

    def stop_all(signum: int, _: FrameType | None = None) -> None:
        nonlocal stopping
        stopping = True
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {s: signal.signal(s, stop_all) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for number in range(settings.workers):
            pid = os.fork()
            if pid == 0:  # the child: no event loop, thread or connection exists yet (all made after)
                for s, handler in previous.items():
                    signal.signal(s, handler)
                _die_with_parent()
                code = 1
                try:
                    code = serve(worker_settings(settings, number))
                except BaseException:  # os._exit skips the interpreter's own report: say it here
                    log.exception("router process %d failed", number)
                finally:
                    os._exit(code)
            children[pid] = number
        log.info("%d router processes on %s:%d", settings.workers, settings.host, settings.port)
        return _wait(children, stop_all, lambda: stopping)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _wait(children: dict[int, int], stop_all: Callable[[int], None], stopping: Callable[[], bool]) -> int:
    status = 0
    while children:
        try:
            pid, raw = os.wait()
        except ChildProcessError:  # pragma: no cover - none left
            break
        number = children.pop(pid, None)
        if number is None:
            continue
        code = os.waitstatus_to_exitcode(raw)
        if not stopping():
            log.error("router process %d (pid %d) exited with status %d: stopping the others", number, pid, code)
            status = code if code > 0 else 1
            stop_all(signal.SIGTERM)
    return status
