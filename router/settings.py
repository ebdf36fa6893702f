"""The router's settings: one frozen dataclass whose fields declare their flags and KVROUTE_*
variables (kvservice.declared); argparse, the environment's reading and docs/router.md's table
are made from it."""

from __future__ import annotations

import argparse
import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from kvindex.settings import RedisSettings, read_secret_lines
from kvservice.declared import Kind, add_declared, nested, of_type, one_of, read_declared, setting
from kvservice.logs import LogSettings
from router.routing.allow import WorkerAllowList
from router.routing.pd import PD_GROUP, PdCosts
from router.routing.scoring import OVERRIDES, Policy, ScoringWeights
from router.routing.tiers import TIERS_GROUP

# The replica's Redis connections (--redis-pool-size), budgeted here only: these stay free for the
# fleet refresh, the lease and the load writer, so they never wait behind decisions (the model's
# sync, once a second, waits for one of them: the pool blocks, it does not fail); the rest is the
# decisions' (their lookups wait for a slot, router.routing.lookups).
RESERVED_CONNECTIONS = 3
MIN_POOL_SIZE = RESERVED_CONNECTIONS + 1  # and one decision at a time
LIMITS = "limits and security"  # --help sections
SECTIONS = {
    OVERRIDES: "the cost is a predicted time to first token, learned online; these only re-weigh its terms",
    TIERS_GROUP: "what a prefix in a worker's CPU, disk or remote tier is worth (docs/router.md, 'Cache tiers')",
    PD_GROUP: "requests of a model with prefill workers (agents' --role) may be split (docs/router.md, "
    "'Prefill/decode fleets')",
    LIMITS: "see docs/router.md and docs/security.md",
}


def _tokenizer_pair(where: str, text: str) -> tuple[str, Path]:
    model, sep, directory = text.partition("=")
    if not sep or not model or not directory:
        raise ValueError(f"{where} takes MODEL=DIR, got {text!r}")
    return model, Path(directory)


class HttpServerKind(StrEnum):
    """Which HTTP server serves the API (issue 56 measures the two side by side)."""

    BUILTIN = "builtin"  # router.http.server: llhttp fed straight from the socket
    AIOHTTP = "aiohttp"  # router.http.aiohttp_server: aiohttp's low-level server


class UpstreamClientKind(StrEnum):
    """Which HTTP client talks to the workers (issue 56 measures the two side by side)."""

    BUILTIN = "builtin"  # router.upstream.pool: llhttp on pooled keep-alive connections
    AIOHTTP = "aiohttp"  # router.upstream.aiohttp_pool: aiohttp's client


@dataclass(frozen=True)
class RouterSettings:
    redis: RedisSettings = nested(RedisSettings)
    host: str = setting("127.0.0.1", flag="--host", help="listen address")
    port: int = setting(8080, flag="--port", parse=of_type(int), help="listen port")
    policy: Policy = setting(
        Policy.KV,
        flag="--policy",
        parse=one_of(Policy),
        choices=tuple(Policy),
        help="kv: the learned cost (a predicted TTFT); the others for A/B comparisons",
    )
    tokenizers: tuple[tuple[str, Path], ...] = setting(
        (),
        flag="--tokenizer",
        kind=Kind.LIST,
        metavar="MODEL=DIR",
        parse=_tokenizer_pair,
        help="a model's directory with tokenizer.json and a chat template (repeatable); without one, the router "
        "asks a worker's /tokenize and caches the answer",
    )
    weights: ScoringWeights = nested(ScoringWeights)
    pd: PdCosts = nested(PdCosts)  # prefill/decode fleets: whether and how to split
    api_keys: frozenset[str] = setting(
        frozenset(),
        repr=False,
        flag="--api-key",
        variable="KVROUTE_API_KEYS",
        kind=Kind.LIST,
        to_field=frozenset,
        group=LIMITS,
        help="an accepted bearer key (repeatable; the variable comma-separated); none: no auth, said by a WARNING "
        "at start-up. The scheme is case-insensitive; keys are compared in constant time",
    )
    api_keys_from_file: frozenset[str] = setting(
        frozenset(),
        repr=False,
        flag="--api-key-file",
        metavar="FILE",
        parse=lambda where, path: read_secret_lines(path, where),
        group=LIMITS,
        help="accepted bearer keys, one a line; with --api-key and KVROUTE_API_KEYS",
    )
    max_body_bytes: int = setting(
        32 * 1024 * 1024,
        flag="--max-body-bytes",
        parse=of_type(int),
        group=LIMITS,
        shown_default="33554432 (32 MiB)",
        help="larger bodies get 413",
    )
    max_prompt_tokens: int = setting(
        1 << 20,
        flag="--max-prompt-tokens",
        parse=of_type(int),
        group=LIMITS,
        help="longer prompts get 413; above any served context length, it bounds what one request costs the router",
    )
    replica_id: str = setting(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}",
        flag="--replica-id",
        shown_default="host-pid-random",
        help="this replica's id in the shared load",
    )
    redis_timeout_s: float = setting(
        0.05,
        flag="--redis-timeout-ms",
        parse=of_type(float),
        to_field=lambda ms: ms / 1000,
        shown_default="50",
        help="a decision's budget for Redis before it routes by local load",
    )
    lease_ttl_ms: int = 3_000
    expected_ttl_ms: int = 2_000
    workers_refresh_s: float = 1.0
    worker_retain_s: float = setting(
        30.0,
        flag="--worker-retain-s",
        parse=of_type(float),
        help="how long the last known workers of a model keep serving while Redis lists none alive (it lost its "
        "data; 0: never)",
    )
    model_sync_ms: int = setting(
        1_000,
        flag="--model-sync-ms",
        parse=of_type(int),
        help="how often the learned cost model is shared with the other replicas through Redis (0: each replica "
        "learns alone)",
    )
    redis_pool_size: int = setting(
        32,
        flag="--redis-pool-size",
        parse=of_type(int),
        help=f"the most Redis connections this replica opens, decisions and background together (at least "
        f"{MIN_POOL_SIZE})",
    )
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    # Hardening of the HTTP API (docs/router.md, "Limits and security").
    header_timeout_s: float = setting(
        60.0,
        flag="--header-timeout-s",
        parse=of_type(float),
        group=LIMITS,
        help="seconds for a request's headers, else the connection is closed; also how long an idle keep-alive "
        "connection stays open",
    )
    body_timeout_s: float = setting(
        60.0,
        flag="--body-timeout-s",
        parse=of_type(float),
        group=LIMITS,
        help="seconds for a request's whole body, else 408 and the connection is closed",
    )
    max_inflight: int = setting(
        1024,
        flag="--max-inflight",
        parse=of_type(int),
        group=LIMITS,
        help="requests under /v1/ and /debug/ handled at once (body reads included); past it 429 with Retry-After",
    )
    upstream_connections: int = setting(
        1024,
        flag="--upstream-connections",
        parse=of_type(int),
        group=LIMITS,
        help="connections to workers, all together; a request past it waits for one",
    )
    upstream_connections_per_worker: int = setting(
        256,
        flag="--upstream-connections-per-worker",
        parse=of_type(int),
        group=LIMITS,
        help="connections to one worker; a request past it waits for one",
    )
    enable_debug: bool = setting(
        False,
        flag="--enable-debug",
        kind=Kind.SWITCH,
        group=LIMITS,
        help="serve POST /debug/route (behind the API key when one is set)",
    )
    expose_routing_headers: bool | None = setting(
        None,
        flag="--expose-routing-headers",
        kind=Kind.TOGGLE,
        group=LIMITS,
        shown_default="on without API keys, off with them",
        help="the x-kvroute-worker and x-kvroute-cached-tokens reply headers; with keys there are tenants, and the "
        "headers tell one of another's prefixes (docs/security.md)",
    )
    worker_allow: tuple[str, ...] = setting(
        (),
        flag="--worker-allow",
        kind=Kind.LIST,
        metavar="CIDR|HOST|.DOMAIN",
        group=LIMITS,
        shown_default="any (a WARNING at start-up)",
        help="route only to workers whose URL host is in this network, is this host name or ends with this domain "
        "(repeatable; the variable comma-separated); a worker outside is ignored with one WARNING",
    )
    workers: int = setting(
        1,
        flag="--workers",
        parse=of_type(int),
        help="router processes on this port (SO_REUSEPORT), each a replica of its own (--replica-id suffixed -w0, "
        "-w1, ...) sharing only Redis; needs a fixed --port. The parent only supervises: a signal goes to all, and "
        "when one exits on its own the others are stopped and the parent exits with its status",
    )
    reuse_port: bool = False  # SO_REUSEPORT: set for each of --workers' processes
    lean_front: bool = setting(
        True,
        flag="--lean-front",
        kind=Kind.TOGGLE,
        group=LIMITS,
        help="deprecated: accepted, ignored, and said so by one WARNING at start-up (one HTTP server serves every "
        "endpoint; --http-server chooses which)",
    )
    http_server: HttpServerKind = setting(
        HttpServerKind.BUILTIN,
        flag="--http-server",
        parse=one_of(HttpServerKind),
        choices=tuple(HttpServerKind),
        group=LIMITS,
        help="the HTTP server of every endpoint: builtin (llhttp on the socket) or aiohttp (aiohttp's low-level "
        "server, same routes, handlers and edge rules)",
    )
    upstream_client: UpstreamClientKind = setting(
        UpstreamClientKind.BUILTIN,
        flag="--upstream-client",
        parse=one_of(UpstreamClientKind),
        choices=tuple(UpstreamClientKind),
        group=LIMITS,
        help="the HTTP client to the workers: builtin (llhttp on pooled connections) or aiohttp (aiohttp's client, "
        "same limits, timeouts and failure rules)",
    )
    log: LogSettings = nested(LogSettings)

    @property
    def lookup_slots(self) -> int:
        """The Redis connections decisions may hold at once (the pool less the reserved ones)."""
        return self.redis_pool_size - RESERVED_CONNECTIONS

    def __post_init__(self) -> None:
        # The keys of --api-key-file join the others here, so that every reader sees one set.
        object.__setattr__(self, "api_keys", frozenset(self.api_keys) | self.api_keys_from_file)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be within 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"--max-prompt-tokens must be at least 1, got {self.max_prompt_tokens}")
        if self.redis_timeout_s <= 0 or self.lease_ttl_ms < 1000:
            raise ValueError("the Redis timeout must be positive and the lease TTL at least 1000 ms")
        if self.model_sync_ms < 0:
            raise ValueError(f"--model-sync-ms must be 0 (off) or more, got {self.model_sync_ms}")
        if self.worker_retain_s < 0:
            raise ValueError(f"--worker-retain-s must be 0 or more, got {self.worker_retain_s}")
        if self.redis_pool_size < MIN_POOL_SIZE:
            raise ValueError(f"--redis-pool-size must be at least {MIN_POOL_SIZE}, got {self.redis_pool_size}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("max_inflight", "upstream_connections", "upstream_connections_per_worker"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.workers > 1 and self.port == 0:
            raise ValueError("--workers above 1 needs a fixed --port (its processes share it)")
        WorkerAllowList(self.worker_allow)  # a malformed entry: its ValueError
        for model, directory in self.tokenizers:
            if not (Path(directory) / "tokenizer.json").is_file():
                raise ValueError(f"--tokenizer {model}={directory}: no tokenizer.json there")

    @property
    def routing_headers(self) -> bool:
        """Whether replies carry the x-kvroute-* headers: as set, else only when no API key is
        configured (with keys there are tenants, and the headers tell one of another's prefixes)."""
        return not self.api_keys if self.expose_routing_headers is None else self.expose_routing_headers

    @property
    def tokenizer_dirs(self) -> dict[str, Path]:
        return {model: Path(directory) for model, directory in self.tokenizers}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``kvroute router``, from :class:`RouterSettings`' declarations."""
    add_declared(parser, RouterSettings, SECTIONS)


def settings_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> RouterSettings:
    """The flags, else the KVROUTE_* variables, else the defaults (kvservice.declared)."""
    return read_declared(RouterSettings, args, os.environ if env is None else env)
