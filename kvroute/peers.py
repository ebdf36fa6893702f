"""Peer routers started for comparisons: the SGLang router (``pip install sglang-router``), its
``cache_aware`` policy, in front of the same workers as kvroute. Each replica is an independent
process with its own approximate prefix tree: that is how it scales out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvroute.embedded_redis import free_port


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
        command = [sglang_python(), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                   "--policy", self.policy, "--prometheus-port", str(free_port()), "--log-level", "warn",
                   "--worker-urls", *self.worker_urls]  # fmt: skip
        log = tempfile.NamedTemporaryFile(prefix="kvroute-sglang-", suffix=".log", delete=False)  # noqa: SIM115
        self._processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log))
        log.close()
        self._logs.append(log.name)
        self.urls.append(f"http://127.0.0.1:{port}")

    async def _wait_up(self, within: float = 60.0) -> None:
        async with aiohttp.ClientSession() as session:
            for process, url, log in zip(self._processes, self.urls, self._logs, strict=True):
                for _ in range(int(within * 10)):
                    if process.poll() is not None:
                        error = _tail(log)
                        hint = f"is sglang-router installed for {sglang_python()}? set KVROUTE_SGLANG_PYTHON"
                        raise PeerError(f"the SGLang router exited with {process.returncode} ({hint}):\n{error}")
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.get(url + "/health") as response:
                            if response.status == 200:
                                break
                    await asyncio.sleep(0.1)
                else:
                    raise PeerError(f"the SGLang router at {url} did not come up within {within:.0f} s")

    def stop(self) -> None:
        for process in self._processes:
            process.terminate()
        for process in self._processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        self._processes.clear()
        for log in self._logs:
            Path(log).unlink(missing_ok=True)
        self._logs.clear()

    async def __aexit__(self, *exc: object) -> None:
        self.stop()


def _tail(path: str) -> str:
    return Path(path).read_text(errors="replace")[-800:]
