"""Connection settings shared by every kvroute process, from flags and KVROUTE_* variables."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.cluster
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvindex.cluster import CLUSTER_SCHEMES, RedisClient, cluster_client, cluster_options, is_cluster_url, startup_nodes
from kvindex.keys import DEFAULT_PREFIX, validate_prefix
from kvservice.declared import Kind, add_declared, declared_fields, read_declared, setting

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


# A password in the query string (redis-py reads ``?password=``), in any letter case.
_QUERY_PASSWORD = re.compile(r"(?i)(^|&)(password=)[^&]*")


def redact_url(url: str) -> str:
    """The URL with any password (in the user part or as ``?password=``) replaced by '***',
    safe for logs and error messages. Anything that does not parse is replaced whole."""
    try:
        parts = urlsplit(url)
        password = parts.password
        netloc = parts.netloc
        if password is not None:
            user = parts.username or ""
            host = parts.netloc.rpartition("@")[2]
            netloc = f"{user}:***@{host}"
    except ValueError:  # a malformed port or host: say nothing of what it held
        return "<unparsable Redis URL>"
    query = _QUERY_PASSWORD.sub(r"\1\2***", parts.query)
    if netloc != parts.netloc:
        url = urlunsplit(parts._replace(netloc=netloc))
    if query != parts.query:  # in place: urlunsplit would turn unix:///path into unix:/path
        url = url.replace("?" + parts.query, "?" + query, 1)
    return url


def _secret_text(path: str, flag: str) -> str:
    """The whole file; one that cannot be read is a ValueError naming the flag and the path."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ValueError(f"cannot read {flag} {path!r}: {reason}") from None


def read_secret_file(path: str, flag: str) -> str:
    """The secret in ``path``: its first line, without the line end. A file that cannot be read,
    or is empty, is a ValueError that names the flag and the path (never the content)."""
    secret = _secret_text(path, flag).partition("\n")[0].rstrip("\r")
    if not secret:
        raise ValueError(f"{flag} {path!r} is empty")
    return secret


def read_secret_lines(path: str | None, flag: str) -> frozenset[str]:
    """The non-empty lines of ``path`` (say API keys, one a line), stripped; none when no path.
    A file that cannot be read, or holds none, is a ValueError naming the flag and the path."""
    if path is None:
        return frozenset()
    lines = frozenset(line.strip() for line in _secret_text(path, flag).split("\n") if line.strip())
    if not lines:
        raise ValueError(f"{flag} {path!r} is empty")
    return lines


def _check_readable(path: str | None, flag: str) -> None:
    if path is not None and not os.access(path, os.R_OK):
        raise ValueError(f"{flag} {path!r} is not a readable file")


@dataclass(frozen=True)
class RedisSettings:
    """Where the index lives and how to reach it. ``password`` (from ``--redis-password-file``)
    and the URL's own password are never shown: see :func:`redact_url` and ``__repr__``.
    ``tls_ca``, ``tls_cert`` and ``tls_key`` are files for a ``rediss://`` URL: the CA that
    signed the server's certificate, and this client's certificate and key (mutual TLS)."""

    url: str = setting(
        DEFAULT_REDIS_URL,
        repr=False,
        flag="--redis-url",
        metavar="URL",
        help="the index's Redis: redis://, rediss:// (TLS), unix://, or redis+cluster://HOST:PORT[,HOST:PORT...] "
        "for a cluster (the only required setting)",
    )
    prefix: str = setting(DEFAULT_PREFIX, flag="--prefix", help="the index's key prefix")
    socket_timeout_s: float = 2.0
    password: str | None = setting(
        None,
        repr=False,
        flag="--redis-password-file",
        metavar="FILE",
        parse=lambda where, path: read_secret_file(path, where),
        help="the Redis password from the file's first line; the user name goes in the URL, "
        "redis://USER@HOST:PORT/0 (docs/security.md)",
    )
    tls_ca: str | None = setting(
        None,
        flag="--redis-tls-ca",
        metavar="FILE",
        help="for a rediss:// URL: the CA (PEM) that signed the server's certificate",
    )
    tls_cert: str | None = setting(
        None,
        flag="--redis-tls-cert",
        metavar="FILE",
        help="for a rediss:// URL: this client's certificate (PEM), for mutual TLS",
    )
    tls_key: str | None = setting(
        None,
        flag="--redis-tls-key",
        metavar="FILE",
        help="for a rediss:// URL: this client's key (PEM), with --redis-tls-cert",
    )
    read_from_replicas: bool = setting(
        False,
        flag="--read-from-replicas",
        variable="KVROUTE_REDIS_READ_FROM_REPLICAS",
        kind=Kind.SWITCH,
        help="with a redis+cluster:// URL, the index's reads (matches, liveness, load) go to each shard's replicas, "
        "round robin",
    )

    def __post_init__(self) -> None:
        try:
            parts = urlsplit(self.url)
        except ValueError:
            raise ValueError(f"Redis URL {redact_url(self.url)} does not parse") from None
        if parts.scheme not in ("redis", "rediss", "unix", *CLUSTER_SCHEMES):
            raise ValueError(
                "Redis URL must start with redis://, rediss://, unix://, redis+cluster:// or rediss+cluster://, "
                f"got {redact_url(self.url)!r}"
            )
        if is_cluster_url(self.url):
            startup_nodes(self.url)  # a ValueError naming the part that is not HOST:PORT
        elif self.read_from_replicas:
            raise ValueError("--read-from-replicas needs a cluster URL (redis+cluster://HOST:PORT,...)")
        validate_prefix(self.prefix)
        if self.socket_timeout_s <= 0:
            raise ValueError(f"socket timeout must be positive, got {self.socket_timeout_s}")
        if self.password is not None and (parts.password or _QUERY_PASSWORD.search(parts.query)):
            raise ValueError("give the Redis password in the URL or in --redis-password-file, not both")
        tls_files = {"--redis-tls-ca": self.tls_ca, "--redis-tls-cert": self.tls_cert, "--redis-tls-key": self.tls_key}
        if any(tls_files.values()) and not parts.scheme.startswith("rediss"):
            raise ValueError(f"TLS files need a rediss:// or rediss+cluster:// URL, got {redact_url(self.url)!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--redis-tls-cert and --redis-tls-key go together (the client certificate and its key)")
        for flag, path in tls_files.items():
            _check_readable(path, flag)

    def __repr__(self) -> str:
        tls = "".join(
            f", {name}={getattr(self, name)!r}" for name in ("tls_ca", "tls_cert", "tls_key") if getattr(self, name)
        )
        secret = ", password='***'" if self.password is not None else ""
        replicas = ", read_from_replicas=True" if self.read_from_replicas else ""
        return (
            f"RedisSettings(url={redact_url(self.url)!r}, prefix={self.prefix!r}, "
            f"socket_timeout_s={self.socket_timeout_s}{secret}{tls}{replicas})"
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] | None = None) -> RedisSettings:
        """From the flags of :func:`add_redis_arguments`, else the KVROUTE_REDIS_* variables and
        KVROUTE_PREFIX (kvservice.declared); the password file is read here, so a missing or empty
        one is a ValueError at start-up."""
        return read_declared(cls, args, os.environ if env is None else env)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> RedisSettings:
        """From the variables, with non-None ``overrides`` winning: ``url``, ``prefix``,
        ``read_from_replicas``, ``password_file``, ``tls_*`` as their flags would give them, any
        other field as itself."""
        flags = {"url": "redis_url", "password_file": "redis_password_file"} | {
            f"tls_{part}": f"redis_tls_{part}" for part in ("ca", "cert", "key")
        }
        given = {k: v for k, v in overrides.items() if v is not None}
        as_flags = argparse.Namespace(**{flags.get(k, k): given.pop(k) for k in list(given) if k in _FLAG_NAMES})
        return read_declared(cls, as_flags, os.environ if env is None else env, **given)

    def connection_options(self) -> dict[str, Any]:
        """The password and TLS files as keyword arguments of redis-py's ``from_url`` (sync or asyncio)."""
        options: dict[str, Any] = {}
        if self.password is not None:
            options["password"] = self.password
        if self.tls_ca:
            options["ssl_ca_certs"] = self.tls_ca
        if self.tls_cert:
            options["ssl_certfile"] = self.tls_cert
            options["ssl_keyfile"] = self.tls_key
        return options

    def client(
        self, command_timeouts: bool = True, max_connections: int | None = None, client_name: str | None = None
    ) -> RedisClient:
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
            **self.connection_options(),
        }
        if client_name:
            options["client_name"] = "".join(c if c.isprintable() and not c.isspace() else "_" for c in client_name)
        if is_cluster_url(self.url):
            # Per node: a cluster client keeps one pool per shard (and replica), and refuses a
            # command at once (MaxConnectionsError) when a node's pool is full rather than wait:
            # twice the bound, so that what the caller sized for one server fits on each node.
            per_node = 2 * max_connections if max_connections else 100
            return cluster_client(self.url, self.read_from_replicas, max_connections=per_node, **options)
        if max_connections is None:
            return Redis.from_url(self.url, **options)
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        pool = BlockingConnectionPool.from_url(
            self.url, max_connections=max_connections, timeout=self.socket_timeout_s, **options
        )
        return Redis.from_pool(pool)  # the client owns the pool: aclose() closes its connections

    def sync_client(self) -> redis.Redis | redis.cluster.RedisCluster:
        """A blocking client (start-up checks, command-line tools) by the same URL rules, password
        and TLS as :meth:`client`, every command bounded by the socket timeout."""
        timeouts = {"socket_timeout": self.socket_timeout_s, "socket_connect_timeout": self.socket_timeout_s}
        options = {**timeouts, **self.connection_options()}
        if not is_cluster_url(self.url):
            return redis.Redis.from_url(self.url, **options)
        nodes, options = cluster_options(self.url, options)
        return redis.cluster.RedisCluster(
            startup_nodes=[redis.cluster.ClusterNode(host, port) for host, port in nodes], **options
        )


# The keys of RedisSettings.from_env's overrides that stand for a flag.
_FLAG_NAMES = frozenset({"url", "prefix", "read_from_replicas", "password_file", "tls_ca", "tls_cert", "tls_key"})
_SECURITY_FLAGS = (
    "--read-from-replicas",
    "--redis-password-file",
    "--redis-tls-ca",
    "--redis-tls-cert",
    "--redis-tls-key",
)


def add_redis_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--redis-url``, ``--prefix`` and :func:`add_redis_security_arguments`: the flags of every
    command that talks to the index's Redis, declared once (on :class:`RedisSettings`)."""
    add_declared(parser, RedisSettings)


def add_redis_security_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The flags every command with ``--redis-url`` takes for a password file, TLS and replica reads."""
    add_declared(parser, RedisSettings, only=_SECURITY_FLAGS)


def export_redis_security_arguments(
    args: argparse.Namespace, env: os._Environ[str] | dict[str, str] = os.environ
) -> None:
    """Put the flags into the KVROUTE_REDIS_* variables, for commands (bench, demo) whose Redis
    clients are built by the processes they start: the children inherit the environment."""
    for _, declared in declared_fields(RedisSettings):
        value = getattr(args, declared.dest, None)
        if declared.flag in _SECURITY_FLAGS and value:
            env[declared.env] = "1" if declared.kind is Kind.SWITCH else str(value)
