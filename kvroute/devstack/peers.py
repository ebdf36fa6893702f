"""Peer routers started for comparisons: the SGLang router (``pip install sglang-router``), its
``cache_aware`` policy, in front of the same workers as kvroute. Each replica is an independent
process with its own approximate prefix tree: that is how it scales out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import aiohttp

from kvroute.devstack.embedded_redis import free_port
from kvroute.devstack.processes import ProcessFailed, remove_files, start_logged, stop_processes, wait_healthy


def sglang_python() -> str:
    """The interpreter that has ``sglang_router``: $KVROUTE_SGLANG_PYTHON, else python3."""
    return os.environ.get("KVROUTE_SGLANG_PYTHON") or shutil.which("python3") or sys.executable


class PeerError(RuntimeError):
    """A peer router would not start (not installed, or it exited)."""


@dataclass
class SglangRouters:
    """``replicas`` SGLang router processes over ``worker_urls``; use with ``async with``."""

    worker_urls: list[str]
    replicas: int = 1
    policy: str = "cache_aware"
    extra_args: tuple[str, ...] = ()  # more of its flags (--disable-health-check, say)
    urls: list[str] = field(default_factory=list)
    _processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _logs: list[str] = field(default_factory=list)

    async def __aenter__(self) -> SglangRouters:
        try:
            for _ in range(self.replicas):
                self._start_one()
            await self._wait_up()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_one(self) -> None:
        port = free_port()
        command = [sglang_python(), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
        command += ["--policy", self.policy, "--prometheus-port", str(free_port()), "--log-level", "warn"]
        command += [*self.extra_args, "--worker-urls", *self.worker_urls]
        process, log = start_logged(command, "sglang")
        self._processes.append(process)
        self._logs.append(log)
        self.urls.append(f"http://127.0.0.1:{port}")

    async def _wait_up(self, within_s: float = 60.0) -> None:
        async with aiohttp.ClientSession() as session:
            for process, url, log in zip(self._processes, self.urls, self._logs, strict=True):
                try:
                    await wait_healthy(session, url + "/health", process, log, within_s, name="the SGLang router")
                except ProcessFailed as exc:
                    what, _, said = str(exc).partition("\n")
                    hint = f"is sglang-router installed for {sglang_python()}? set KVROUTE_SGLANG_PYTHON"
                    raise PeerError(f"{what.rstrip(':')} ({hint})" + (f":\n{said}" if said else "")) from None

    def stop(self) -> None:
        stop_processes(self._processes)
        self._processes.clear()
        remove_files(self._logs)
        self._logs.clear()

    async def __aexit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class GreedyOracle:
    """The greedy oracle (:mod:`kvroute.devstack.oracle`) over ``worker_urls``: one process, which
    every "replica" of a run shares (it knows everything; its ``urls`` repeat its one URL)."""

    worker_urls: list[str]
    replicas: int = 1
    urls: list[str] = field(default_factory=list)
    _process: subprocess.Popen[bytes] | None = None
    _log: str = ""

    async def __aenter__(self) -> GreedyOracle:
        port = free_port()
        command = [sys.executable, "-m", "kvroute.devstack.oracle", "--port", str(port)]
        command += ["--worker-urls", *self.worker_urls]
        self._process, self._log = start_logged(command, "oracle")
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                await wait_healthy(session, url + "/health", self._process, self._log, 60.0, name="the greedy oracle")
        except BaseException:
            self.stop()
            raise
        self.urls = [url] * self.replicas
        return self

    def stop(self) -> None:
        if self._process is not None:
            stop_processes([self._process])
            remove_files([self._log])
            self._process = None

    async def __aexit__(self, *exc: object) -> None:
        self.stop()
