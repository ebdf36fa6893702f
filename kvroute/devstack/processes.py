"""The processes the development stack, the demo and the benchmarks start, and waiting for them
on observable state, written once:

* processes: :func:`start_logged` (stderr to a log file), :func:`tail` of that log,
  :func:`stop_processes` (terminate, then kill what lingers), :func:`remove_files`;
* waiting: :func:`poll_until`, :func:`wait_healthy` (an HTTP health endpoint, failing early with
  the log's tail when the process behind it exits), :func:`exited`;
* servers: :func:`serve_app` (a local aiohttp server).

It imports nothing from the rest of the project.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web


class ProcessFailed(RuntimeError):
    """A process this command started exited, or did not come up in time; the message says which."""


def start_logged(
    command: Sequence[str],
    name: str,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdout_too: bool = False,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``command`` with stdout discarded (``stdout_too``: logged as well, for a server that
    logs there, as vLLM does) and stderr in a temporary log file; (process, log path). The caller
    removes the log (:func:`remove_files`)."""
    log = tempfile.NamedTemporaryFile(prefix=f"kvroute-{name}-", suffix=".log", delete=False)  # noqa: SIM115
    stdout: Any = log if stdout_too else subprocess.DEVNULL
    try:
        return subprocess.Popen(command, stdout=stdout, stderr=log, env=env, cwd=cwd), log.name
    finally:
        log.close()


def tail(path: str, chars: int = 2000) -> str:
    """The end of a process's log (what it said before it exited)."""
    try:
        return Path(path).read_text(errors="replace")[-chars:].strip()
    except OSError:
        return ""


def stop_processes(processes: Iterable[subprocess.Popen[Any]], timeout_s: float = 10.0) -> None:
    """SIGTERM every process, then wait for each; one that does not exit in time is killed."""
    processes = [p for p in processes if p.poll() is None]
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def remove_files(paths: Iterable[str]) -> None:
    for path in paths:
        Path(path).unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------- agents


def agent_command(
    engine_url: str,
    events: str,
    *,
    redis_url: str,
    replay: str | None = None,
    prefix: str | None = None,
    model: str | None = None,
    block_size: int | None = None,
    metrics_port: int | None = None,
    log_level: str = "WARNING",
    role: str | None = None,
) -> list[str]:
    """The command of an agent following one engine (topic ``kv``), as the dev stack and the
    benchmarks start it; ``metrics_port`` on 127.0.0.1 (default: the agent's own)."""
    command = [sys.executable, "-m", "worker_agent", "--engine-url", engine_url, "--events", events]
    command += ["--topic", "kv", "--redis-url", redis_url, "--log-level", log_level]
    flags = (("--replay", replay), ("--prefix", prefix), ("--model", model), ("--block-size", block_size))
    for flag, value in (*flags, ("--role", role)):
        if value is not None:
            command += [flag, str(value)]
    if metrics_port is not None:
        command += ["--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"]
    return command


# ---------------------------------------------------------------------------------------- waiting


async def poll_until(
    check: Callable[[], Awaitable[bool]], what: str, within_s: float = 60.0, interval_s: float = 0.05
) -> float:
    """Call ``check`` until it returns True; the seconds it took. :class:`ProcessFailed` naming
    ``what`` after ``within_s``. ``check`` may raise (a process it watches has exited) to end the
    wait early. (The tests wait with it too: ``tests.support.wait_until``.)"""
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > within_s:
            raise ProcessFailed(f"{what} within {within_s:g} s")
        await asyncio.sleep(interval_s)
    return time.monotonic() - started


def exited(process: subprocess.Popen[Any] | None, log: str | None, name: str) -> ProcessFailed | None:
    """A :class:`ProcessFailed` saying how ``process`` ended (with its log's tail), or None while it runs."""
    if process is None or process.poll() is None:
        return None
    said = tail(log) if log else ""
    return ProcessFailed(f"{name} exited with status {process.returncode}" + (f":\n{said}" if said else ""))


async def wait_healthy(
    session: aiohttp.ClientSession,
    url: str,
    process: subprocess.Popen[Any] | None = None,
    log: str | None = None,
    within_s: float = 60.0,
    name: str = "",
) -> None:
    """GET ``url`` until it answers 200. When ``process`` (the server behind it) exits first, fail at
    once with the tail of its ``log``; on timeout, the last answer or error is in the message."""
    name = name or url
    last = "no answer"

    async def up() -> bool:
        nonlocal last
        if (failure := exited(process, log, name)) is not None:
            raise failure
        try:
            async with session.get(url) as response:
                if response.status == 200:
                    return True
                last = f"{response.status} {(await response.text())[:200]}"
        except aiohttp.ClientError as exc:
            last = repr(exc)
        return False

    await poll_until(up, f"{name} did not answer 200 on {url} (last: {last})", within_s, 0.1)


async def serve_app(app: web.Application, port: int, host: str = "127.0.0.1") -> web.AppRunner:
    """Serve ``app`` on ``host:port`` (no access log) until the caller cleans the runner up."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
