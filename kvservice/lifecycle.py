"""Start-up and shutdown of a long-running command, the same for every kvroute process.

* :class:`StartupError`: a mistake in the settings or the environment found while starting (a
  port already in use, a Redis URL that cannot be used); :func:`run_service` prints it as one line
  and exits with status 2, never a traceback.
* :func:`listening`: turns "address already in use" and friends into a :class:`StartupError`
  that names the flag to change.
* :func:`serve_until_signal`: runs an async context manager (the service) until SIGTERM or
  SIGINT; everything it started is closed by the context manager's own exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import sys
from collections.abc import Callable, Coroutine, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

T = TypeVar("T")
EXIT_BAD_SETTINGS = 2
EXIT_INTERRUPTED = 130
_BIND_PROBLEMS = {
    errno.EADDRINUSE: "the address is already in use",
    errno.EACCES: "permission denied",
    errno.EADDRNOTAVAIL: "the address is not on this machine",
}


class StartupError(Exception):
    """A settings or environment problem found at start-up; the message is the whole story."""


@contextlib.contextmanager
def listening(what: str, address: str, flag: str) -> Iterator[None]:
    """Bind inside this block; a bind failure becomes a one-line :class:`StartupError`.

    Works for sockets (``OSError``) and ZMQ (``zmq.ZMQError``): both carry ``errno``."""
    try:
        yield
    except Exception as exc:
        problem = _BIND_PROBLEMS.get(getattr(exc, "errno", None) or -1)
        if problem is None:
            raise
        raise StartupError(
            f"cannot listen on {address} for {what}: {problem}; pass another {flag} or stop the process using it"
        ) from None


@contextlib.contextmanager
def on_signals(
    callback: Callable[[], None], signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
) -> Iterator[None]:
    """Call ``callback`` on any of ``signals`` while the block runs (then the old handling is back)."""
    loop = asyncio.get_running_loop()
    for signum in signals:
        loop.add_signal_handler(signum, callback)
    try:
        yield
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


async def serve_until_signal(service: AbstractAsyncContextManager[T], ready: Callable[[T], None] | None = None) -> None:
    """Enter ``service``, call ``ready`` with it, and wait for SIGTERM/SIGINT; then exit it."""
    stop = asyncio.Event()
    with on_signals(stop.set):
        async with service as running:
            if ready is not None:
                ready(running)
            await stop.wait()


def run_service(prog: str, main: Callable[[], Coroutine[Any, Any, int | None]]) -> int:
    """Run ``main`` on uvloop (asyncio where uvloop is missing) and map the ends to exit codes:
    its own result, 2 with one line for a :class:`StartupError`, 130 for Ctrl-C."""
    try:
        import uvloop

        result = uvloop.run(main())
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        result = asyncio.run(main())
    except StartupError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return int(result or 0)
