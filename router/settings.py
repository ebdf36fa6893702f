"""The router's settings: one frozen dataclass, from flags and KVROUTE_* environment variables."""

from __future__ import annotations

import argparse
import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from kvindex.settings import RedisSettings, add_redis_arguments, read_secret_lines, redis_security_overrides
from kvservice.logs import add_log_arguments
from kvservice.options import choice, flag_or_env, parse_switch, typed
from router.pd_settings import add_pd_arguments, pd_costs
from router.routing.allow import WorkerAllowList
from router.routing.pd import PdCosts
from router.routing.scoring import Policy, ScoringWeights
from router.routing.tiers import TierCosts, TierMode, parse_tier_values

# The replica's Redis connections (--redis-pool-size), budgeted here only: these stay free for the
# fleet refresh, the lease and the load writer, so they never wait behind decisions (the model's
# sync, once a second, waits for one of them: the pool blocks, it does not fail); the rest is the
# decisions' (their lookups wait for a slot, router.routing.lookups).
RESERVED_CONNECTIONS = 3
MIN_POOL_SIZE = RESERVED_CONNECTIONS + 1  # and one decision at a time
# Settings that a flag or a KVROUTE_* variable sets (the flag wins): name -> (variable, type).
ENV_SETTINGS: dict[str, tuple[str, type]] = {
    "max_body_bytes": ("KVROUTE_MAX_BODY_BYTES", int),
    "max_prompt_tokens": ("KVROUTE_MAX_PROMPT_TOKENS", int),
    "redis_pool_size": ("KVROUTE_REDIS_POOL_SIZE", int),
    "worker_retain_s": ("KVROUTE_WORKER_RETAIN_S", float),
    "model_sync_ms": ("KVROUTE_MODEL_SYNC_MS", int),
    "header_timeout_s": ("KVROUTE_HEADER_TIMEOUT_S", float),
    "body_timeout_s": ("KVROUTE_BODY_TIMEOUT_S", float),
    "max_inflight": ("KVROUTE_MAX_INFLIGHT", int),
    "upstream_connections": ("KVROUTE_UPSTREAM_CONNECTIONS", int),
    "upstream_connections_per_worker": ("KVROUTE_UPSTREAM_CONNECTIONS_PER_WORKER", int),
}


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
    redis: RedisSettings = field(default_factory=RedisSettings)
    host: str = "127.0.0.1"
    port: int = 8080
    policy: Policy = Policy.KV
    tokenizers: tuple[tuple[str, Path], ...] = ()  # (model, model directory)
    weights: ScoringWeights = field(default_factory=ScoringWeights)
    pd: PdCosts = field(default_factory=PdCosts)  # prefill/decode fleets: whether and how to split
    api_keys: frozenset[str] = field(default=frozenset(), repr=False)
    max_body_bytes: int = 32 * 1024 * 1024
    max_prompt_tokens: int = 1 << 20  # beyond any served context length; bounds hashing and caches
    replica_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}")
    redis_timeout_s: float = 0.05  # a routing decision waits this long for Redis, then degrades
    lease_ttl_ms: int = 3_000
    expected_ttl_ms: int = 2_000
    workers_refresh_s: float = 1.0
    worker_retain_s: float = 30.0  # last known workers kept while Redis lists none (lost data)
    model_sync_ms: int = 1_000  # the learned cost model shared with the other replicas this often; 0: not
    redis_pool_size: int = 32  # Redis connections of this replica, at most (decisions + background)
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    # Hardening of the HTTP API (docs/router.md, "Limits and security").
    header_timeout_s: float = 60.0  # a request's headers, and an idle keep-alive connection's next ones
    body_timeout_s: float = 60.0  # a request's whole body; a client slower than this gets 408
    max_inflight: int = 1024  # requests under /v1/ and /debug/ at once; past it: 429 with Retry-After
    upstream_connections: int = 1024  # connections to workers, at most, all together
    upstream_connections_per_worker: int = 256
    enable_debug: bool = False  # /debug/* served at all
    expose_routing_headers: bool | None = None  # x-kvroute-* on replies; None: only without API keys
    worker_allow: tuple[str, ...] = ()  # worker URL hosts/networks routed to; empty: any (warned)
    workers: int = 1  # router processes on this port (router.workers), each its own replica
    reuse_port: bool = False  # SO_REUSEPORT: set for each of --workers' processes
    lean_front: bool = True  # kept for compatibility: one HTTP server serves every endpoint (router.http)
    http_server: HttpServerKind = HttpServerKind.BUILTIN  # the server of every endpoint
    upstream_client: UpstreamClientKind = UpstreamClientKind.BUILTIN  # the client to the workers

    @property
    def lookup_slots(self) -> int:
        """The Redis connections decisions may hold at once (the pool less the reserved ones)."""
        return self.redis_pool_size - RESERVED_CONNECTIONS

    def __post_init__(self) -> None:
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


def _tokenizer_pair(text: str) -> tuple[str, Path]:
    model, sep, directory = text.partition("=")
    if not sep or not model or not directory:
        raise argparse.ArgumentTypeError(f"--tokenizer takes MODEL=DIR, got {text!r}")
    return model, Path(directory)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d, w = RouterSettings(), ScoringWeights()
    add_redis_arguments(parser)
    parser.add_argument("--host", default=d.host, help=f"listen address (default {d.host})")
    parser.add_argument("--port", type=int, default=d.port, help=f"listen port (default {d.port})")
    parser.add_argument("--policy", type=Policy, choices=list(Policy), default=Policy.KV, help="default kv")
    parser.add_argument(
        "--tokenizer",
        type=_tokenizer_pair,
        action="append",
        default=[],
        metavar="MODEL=DIR",
        help="a model's directory with tokenizer.json + chat template (repeatable); without one, "
        "the router asks a worker's /tokenize",
    )
    advanced = parser.add_argument_group(
        "scoring overrides",
        "the cost is a predicted time to first token, learned online; these only re-weigh its terms",
    )
    advanced.add_argument("--weight-prefill", type=float, default=w.prefill, help=f"own uncached tokens ({w.prefill})")
    advanced.add_argument("--weight-queued", type=float, default=w.queued, help=f"prefill queued ahead ({w.queued})")
    advanced.add_argument("--weight-active", type=float, default=w.active, help=f"in-flight prompt tokens ({w.active})")
    advanced.add_argument("--weight-queue", type=float, default=w.queue, help=f"extra per queued request ({w.queue})")
    advanced.add_argument(
        "--weight-cache-pressure",
        type=float,
        default=None,
        help="per token a prefill would evict from a full cache (default: the measured cache hit rate)",
    )
    tiers = parser.add_argument_group(
        "cache tiers",
        "what a prefix in a worker's CPU, disk or remote tier is worth (docs/router.md, 'Cache tiers')",
    )
    tiers.add_argument(
        "--tier-cost",
        choices=[m.value for m in TierMode],
        help="time: a loaded block costs its load time, --tier-load-ms (default); learned: a load costs what "
        "TTFTs taught, a wait per load and a time per token, starting from --tier-load-ms; weights: it counts "
        "as cached by its tier's weight (--tier-weights); ignore: only GPU blocks count (env KVROUTE_TIER_COST)",
    )
    tiers.add_argument(
        "--tier-load-ms",
        metavar="TIER=MS,...",
        help="load time per 1k tokens of each lower tier (default CPU=4,DISK=30,REMOTE=60: an 8B model's KV "
        "over PCIe Gen5, a local NVMe, a remote store; env KVROUTE_TIER_LOAD_MS)",
    )
    tiers.add_argument(
        "--tier-weights",
        metavar="TIER=W,...",
        help="with --tier-cost weights: each lower tier's weight of a GPU hit (default CPU=0.75,DISK=0.25,"
        "REMOTE=0.25, Dynamo's; env KVROUTE_TIER_WEIGHTS)",
    )
    add_pd_arguments(parser)
    parser.add_argument("--busy-kv-usage", type=float, default=w.busy_kv_usage, help=f"busy above ({w.busy_kv_usage})")
    parser.add_argument(
        "--busy-waiting", type=int, default=w.busy_waiting, help=f"busy at this queue ({w.busy_waiting})"
    )
    parser.add_argument("--temperature", type=float, default=w.temperature, help="softmax temperature (0: argmin)")
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted bearer key (repeatable; env KVROUTE_API_KEYS, comma-separated); none: no auth",
    )
    parser.add_argument("--api-key-file", help="accepted bearer keys, one a line (env KVROUTE_API_KEY_FILE)")
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        help=f"larger request bodies get 413 (env KVROUTE_MAX_BODY_BYTES; default {d.max_body_bytes})",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        help=f"longer prompts get 413 (env KVROUTE_MAX_PROMPT_TOKENS; default {d.max_prompt_tokens})",
    )
    parser.add_argument("--replica-id", help="this replica's id in the shared load (default host-pid-random)")
    parser.add_argument(
        "--workers",
        type=int,
        default=d.workers,
        help="router processes sharing the port (SO_REUSEPORT), each a replica of its own with --replica-id "
        "suffixed -w0, -w1, ...; they share only Redis (default 1)",
    )
    parser.add_argument(
        "--redis-timeout-ms",
        type=float,
        default=d.redis_timeout_s * 1000,
        help="decision budget for Redis before routing by local load (default 50)",
    )
    parser.add_argument(
        "--redis-pool-size",
        type=int,
        help=f"most Redis connections this replica opens (env KVROUTE_REDIS_POOL_SIZE; default {d.redis_pool_size})",
    )
    parser.add_argument(
        "--worker-retain-s",
        type=float,
        help="seconds the last known workers of a model keep serving while Redis lists none alive (it "
        f"lost its data; env KVROUTE_WORKER_RETAIN_S; default {d.worker_retain_s:g})",
    )
    parser.add_argument(
        "--model-sync-ms",
        type=int,
        help="how often the learned cost model is shared with the other replicas through Redis, in ms "
        f"(0: each replica learns alone; env KVROUTE_MODEL_SYNC_MS; default {d.model_sync_ms})",
    )
    _add_hardening_arguments(parser, d)
    add_log_arguments(parser)


def _add_hardening_arguments(parser: argparse.ArgumentParser, d: RouterSettings) -> None:
    group = parser.add_argument_group("limits and security", "see docs/router.md and docs/security.md")
    group.add_argument(
        "--header-timeout-s",
        type=float,
        help="seconds for a request's headers, and an idle keep-alive connection's next request, "
        f"before the connection is closed (env KVROUTE_HEADER_TIMEOUT_S; default {d.header_timeout_s:g})",
    )
    group.add_argument(
        "--body-timeout-s",
        type=float,
        help=f"seconds for a request's whole body, else 408 (env KVROUTE_BODY_TIMEOUT_S; default {d.body_timeout_s:g})",
    )
    group.add_argument(
        "--max-inflight",
        type=int,
        help="requests under /v1/ and /debug/ handled at once; more get 429 with Retry-After "
        f"(env KVROUTE_MAX_INFLIGHT; default {d.max_inflight})",
    )
    group.add_argument(
        "--upstream-connections",
        type=int,
        help="connections to workers, all together "
        f"(env KVROUTE_UPSTREAM_CONNECTIONS; default {d.upstream_connections})",
    )
    group.add_argument(
        "--upstream-connections-per-worker",
        type=int,
        help="connections to one worker (env KVROUTE_UPSTREAM_CONNECTIONS_PER_WORKER; "
        f"default {d.upstream_connections_per_worker})",
    )
    group.add_argument(
        "--enable-debug",
        action="store_true",
        default=None,
        help="serve /debug/route (behind the API key when one is set; env KVROUTE_ENABLE_DEBUG=1)",
    )
    group.add_argument(
        "--expose-routing-headers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="x-kvroute-worker and x-kvroute-cached-tokens on replies (env KVROUTE_EXPOSE_ROUTING_HEADERS; "
        "default: on without API keys, off with them, as they tell a tenant of another's prefixes)",
    )
    group.add_argument(
        "--lean-front",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="deprecated, ignored with a warning: the router serves every endpoint on one HTTP server "
        "(env KVROUTE_LEAN_FRONT)",
    )
    group.add_argument(
        "--http-server",
        type=HttpServerKind,
        choices=list(HttpServerKind),
        default=None,
        help="the HTTP server of every endpoint: builtin (llhttp on the socket) or aiohttp (aiohttp's "
        f"low-level server; same routes and edge rules) (env KVROUTE_HTTP_SERVER; default {d.http_server.value})",
    )
    group.add_argument(
        "--upstream-client",
        type=UpstreamClientKind,
        choices=list(UpstreamClientKind),
        default=None,
        help="the HTTP client to the workers: builtin (llhttp on pooled connections) or aiohttp (aiohttp's "
        f"client; same limits and timeouts) (env KVROUTE_UPSTREAM_CLIENT; default {d.upstream_client.value})",
    )
    group.add_argument(
        "--worker-allow",
        action="append",
        default=[],
        metavar="CIDR|HOST|.DOMAIN",
        help="route only to workers whose URL host is in this network, is this host name or ends with this "
        "domain (repeatable; env KVROUTE_WORKER_ALLOW, comma-separated; default: any, with a warning)",
    )


def settings_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> RouterSettings:
    env = os.environ if env is None else env
    keys = set(args.api_key) | {k.strip() for k in env.get("KVROUTE_API_KEYS", "").split(",") if k.strip()}
    keys |= read_secret_lines(args.api_key_file or env.get("KVROUTE_API_KEY_FILE"), "--api-key-file")
    weights = ScoringWeights(
        args.weight_prefill,
        args.weight_queued,
        args.weight_active,
        args.weight_queue,
        args.busy_kv_usage,
        args.busy_waiting,
        args.temperature,
        args.weight_cache_pressure,
        _tier_costs(args, env),
    )
    extra: dict[str, object] = {"replica_id": args.replica_id} if args.replica_id else {}
    extra.update(_flag_or_env(args, env))
    extra.update(_switches(args, env))
    extra.update(
        flag_or_env(
            args,
            env,
            [
                ("http_server", "KVROUTE_HTTP_SERVER", choice(HttpServerKind)),
                ("upstream_client", "KVROUTE_UPSTREAM_CLIENT", choice(UpstreamClientKind)),
            ],
        )
    )
    allow = [*args.worker_allow, *(h.strip() for h in env.get("KVROUTE_WORKER_ALLOW", "").split(",") if h.strip())]
    if allow:
        extra["worker_allow"] = tuple(allow)
    return RouterSettings(
        redis=RedisSettings.from_env(env, url=args.redis_url, prefix=args.prefix, **redis_security_overrides(args)),
        host=args.host,
        port=args.port,
        policy=args.policy,
        tokenizers=tuple(args.tokenizer),
        weights=weights,
        pd=pd_costs(args, env),
        api_keys=frozenset(keys),
        redis_timeout_s=args.redis_timeout_ms / 1000,
        workers=getattr(args, "workers", 1),
        **extra,  # type: ignore[arg-type]
    )


_SWITCHES = (
    ("enable_debug", "KVROUTE_ENABLE_DEBUG"),
    ("expose_routing_headers", "KVROUTE_EXPOSE_ROUTING_HEADERS"),
    ("lean_front", "KVROUTE_LEAN_FRONT"),
)


def _tier_costs(args: argparse.Namespace, env: Mapping[str, str]) -> TierCosts:
    """--tier-cost, --tier-load-ms and --tier-weights, else their variables, else the defaults."""

    def values(variable: str, text: str) -> dict[str, float]:
        return parse_tier_values(text, variable)

    given = flag_or_env(
        argparse.Namespace(
            mode=getattr(args, "tier_cost", None),
            load_ms_per_1k=getattr(args, "tier_load_ms", None),
            weights=getattr(args, "tier_weights", None),
        ),
        env,
        [
            ("mode", "KVROUTE_TIER_COST", choice(TierMode)),
            ("load_ms_per_1k", "KVROUTE_TIER_LOAD_MS", values),
            ("weights", "KVROUTE_TIER_WEIGHTS", values),
        ],
    )
    for name, flag in (("load_ms_per_1k", "--tier-load-ms"), ("weights", "--tier-weights")):
        if isinstance(given.get(name), str):  # the flag's text
            given[name] = parse_tier_values(given[name], flag)
    if isinstance(given.get("mode"), str):
        given["mode"] = TierMode(given["mode"])
    return TierCosts(**given)


def _flag_or_env(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, object]:
    """The :data:`ENV_SETTINGS` given by a flag, else by their variable (kvservice.options)."""
    return flag_or_env(args, env, [(name, variable, typed(kind)) for name, (variable, kind) in ENV_SETTINGS.items()])


def _switches(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, object]:
    """The on/off settings: the flag, else the variable (1/true/yes/on or 0/false/no/off)."""
    return flag_or_env(args, env, [(name, variable, parse_switch) for name, variable in _SWITCHES])
