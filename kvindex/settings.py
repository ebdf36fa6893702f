"""Connection settings shared by every kvroute process, from flags and KVROUTE_* variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvindex.keys import DEFAULT_PREFIX, validate_prefix

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redact_url(url: str) -> str:
    """The URL with any password replaced by '***', safe for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


@dataclass(frozen=True)
class RedisSettings:
    url: str = field(default=DEFAULT_REDIS_URL, repr=False)
    prefix: str = DEFAULT_PREFIX
    socket_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"Redis URL must start with redis://, rediss:// or unix://, got {redact_url(self.url)!r}")
        validate_prefix(self.prefix)
        if self.socket_timeout_s <= 0:
            raise ValueError(f"socket timeout must be positive, got {self.socket_timeout_s}")

    def __repr__(self) -> str:
        return (
            f"RedisSettings(url={redact_url(self.url)!r}, prefix={self.prefix!r}, "
            f"socket_timeout_s={self.socket_timeout_s})"
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> RedisSettings:
        """Build from KVROUTE_REDIS_URL / KVROUTE_PREFIX, with non-None ``overrides`` (flags) winning."""
        env = os.environ if env is None else env
        values: dict[str, object] = {
            "url": env.get("KVROUTE_REDIS_URL", DEFAULT_REDIS_URL),
            "prefix": env.get("KVROUTE_PREFIX", DEFAULT_PREFIX),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]

    def client(
        self, command_timeouts: bool = True, max_connections: int | None = None, client_name: str | None = None
    ) -> Redis:
        """A client that reconnects once a dropped connection is noticed (a restarted server
        closes every pooled connection; the first command on each would fail otherwise).

        ``command_timeouts=False`` leaves per-command socket timeouts to the caller (the router
        bounds each decision itself; redis-py's own timeout costs a task per command).
        ``max_connections`` bounds the pool: a command waits for a free connection (at most the
        socket timeout) instead of opening one more. ``client_name`` names the connections in
        CLIENT LIST (spaces and control characters become '_', which Redis would refuse)."""
        options: dict[str, Any] = {
            "socket_timeout": self.socket_timeout_s if command_timeouts else None,
            "socket_connect_timeout": self.socket_timeout_s,
            "retry": Retry(ExponentialBackoff(cap=0.5, base=0.01), retries=3),
            "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        }
        if client_name:
            options["client_name"] = "".join(c if c.isprintable() and not c.isspace() else "_" for c in client_name)
        if max_connections is None:
            return Redis.from_url(self.url, **options)
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        pool = BlockingConnectionPool.from_url(
            self.url, max_connections=max_connections, timeout=self.socket_timeout_s, **options
        )
        return Redis.from_pool(pool)  # the client owns the pool: aclose() closes its connections
