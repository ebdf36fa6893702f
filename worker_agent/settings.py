"""The agent's settings: one frozen dataclass, from flags and KVROUTE_* environment variables.
Logging (``--log-level``, ``--log-format``) is :mod:`kvservice.logs`'s, added to the same parser."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvindex.roles import BOTH, ROLES, role_of_kv_role
from kvindex.settings import RedisSettings, add_redis_arguments, redis_security_overrides
from kvindex.tiers import TIERS, parse_tiers
from kvservice.logs import add_log_arguments
from kvservice.options import flag_or_env, parse_switch, typed
from worker_agent.engine import root_url
from worker_agent.engine_kinds import ENGINE_KINDS, TRTLLM

# flag dest -> environment variable (flags win over the environment)
ENV_VARS = {
    "engine_url": "KVROUTE_ENGINE_URL",
    "events": "KVROUTE_EVENTS",
    "replay": "KVROUTE_REPLAY",
    "topic": "KVROUTE_TOPIC",
    "model": "KVROUTE_MODEL",
    "block_size": "KVROUTE_BLOCK_SIZE",
    "dp_rank": "KVROUTE_DP_RANK",
    "worker_id": "KVROUTE_WORKER_ID",
    "metrics_port": "KVROUTE_METRICS_PORT",
    "metrics_host": "KVROUTE_METRICS_HOST",
    "events_warn_after": "KVROUTE_EVENTS_WARN_AFTER",
    "events_bind": "KVROUTE_EVENTS_BIND",
    "tiers": "KVROUTE_TIERS",
    "role": "KVROUTE_ROLE",
    "kv_transfer_config": "KVROUTE_KV_TRANSFER_CONFIG",
    "engine_kind": "KVROUTE_ENGINE_KIND",
}
_INTS = ("block_size", "dp_rank", "metrics_port")
_FLOATS = ("events_warn_after",)


@dataclass(frozen=True)
class AgentSettings:
    engine_url: str
    # a ZMQ endpoint; for TensorRT-LLM an http(s) URL it is polled at, or None: the engine's /kv_cache_events
    events: str | None = None
    redis: RedisSettings = field(default_factory=RedisSettings)
    replay: str | None = None
    topic: str = ""
    model: str | None = None  # None: ask the engine's /v1/models
    block_size: int | None = None  # None: the engine's /metrics, else the first BlockStored
    dp_rank: int = 0
    worker_id: str | None = None  # None: "<engine root url>#<dp rank>"
    metrics_host: str = "127.0.0.1"  # as the router's: listening beyond this host is the operator's choice
    metrics_port: int = 0  # 0: no HTTP server
    heartbeat_interval_s: float = 1.0
    ttl_ms: int = 5_000
    load_interval_s: float = 0.25
    health_interval_s: float = 1.0
    health_failures: int = 3  # consecutive /health failures that mean the engine is down
    verify_interval_s: float = 5.0  # compare the index's block count with the mirror
    reassert_interval_s: float = 3600.0  # rewrite everything anyway, so any drift heals
    gc_interval_s: float = 10.0
    replay_timeout_s: float = 2.0  # a replay's idle timeout
    replay_deadline_s: float = 5.0  # a replay's total time bound
    # Limits on what one engine can make the agent hold (see docs/agent.md, "Limits").
    max_message_bytes: int = 16 << 20  # per ZMQ frame: ~27x a 64k-token step's batch
    max_queued_messages: int = 100_000  # received, not yet applied (vLLM's own send HWM)
    max_queued_bytes: int = 256 << 20
    # Warn when the engine keeps serving requests this long with no KV event arriving (0: never).
    events_warn_after_s: float = 30.0
    # Listen for KV events on a wildcard --events endpoint (for an engine told to connect to the
    # agent). Off by default: a bound SUB takes events from any publisher that reaches the port.
    events_bind: bool = False
    # The cache tiers indexed (kvindex/tiers.py): every tier the engine reports, by default.
    tiers: frozenset[str] = frozenset(TIERS)
    # Its part in a prefill/decode split (kvindex/roles.py): --role, else the kv_role of the
    # engine's --kv-transfer-config, else both.
    role: str = BOTH
    # vllm, sglang or trtllm (worker_agent/engine_kinds.py); None: what the engine's /v1/models says, else vllm
    engine_kind: str | None = None

    def __post_init__(self) -> None:
        if urlsplit(self.engine_url).scheme not in ("http", "https"):
            raise ValueError(f"--engine-url must be an http(s) URL, got {self.engine_url!r}")
        self._check_events()
        if self.replay is not None and "://" not in self.replay:
            raise ValueError(f"--replay must be a ZMQ endpoint like tcp://host:5558, got {self.replay!r}")
        if self.events is not None and _is_wildcard(self.events) and not self.events_bind:
            raise ValueError(
                f"--events {self.events} would make the agent listen for KV events from anyone who can reach "
                "that port; name the engine's host to connect to it (tcp://engine:5557), or pass --events-bind "
                "(KVROUTE_EVENTS_BIND=1) for an engine told to connect to this agent"
            )
        if self.events_bind and not (self.events is not None and _is_wildcard(self.events)):
            raise ValueError(
                f"--events-bind needs a wildcard --events endpoint such as tcp://*:5557, got {self.events}"
            )
        if self.replay is not None and "*" in self.replay:
            raise ValueError(
                f"--replay must name the engine's host (the agent connects to its replay socket), got {self.replay!r}"
            )
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"--block-size must be positive, got {self.block_size}")
        if self.dp_rank < 0:
            raise ValueError(f"--dp-rank must be >= 0, got {self.dp_rank}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be within 0..65535, got {self.metrics_port}")
        if self.ttl_ms < 2 * 1000 * self.heartbeat_interval_s:
            raise ValueError("the heartbeat TTL must cover at least two heartbeat intervals")
        if self.reassert_interval_s <= 0 or self.verify_interval_s <= 0:
            raise ValueError("--reassert-interval and --verify-interval must be positive")
        if not self.replay_deadline_s > 0:  # NaN too
            raise ValueError(f"--replay-deadline must be positive, got {self.replay_deadline_s}")
        for flag, value in (
            ("--max-message-bytes", self.max_message_bytes),
            ("--max-queued-messages", self.max_queued_messages),
            ("--max-queued-bytes", self.max_queued_bytes),
        ):
            if value <= 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        if self.worker_id is not None and not self.worker_id:
            raise ValueError("--worker-id must not be empty")
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        _check_engine_kind(self.engine_kind)
        if not self.events_warn_after_s >= 0:  # NaN too
            raise ValueError(f"--events-warn-after must be >= 0 (0: never warn), got {self.events_warn_after_s}")

    def _check_events(self) -> None:
        polled = self.polled
        if self.events is None:
            if not polled:
                raise ValueError("missing required setting(s): --events (or KVROUTE_EVENTS)")
            return
        if polled and urlsplit(self.events).scheme not in ("http", "https"):
            raise ValueError(
                f"--engine-kind trtllm fetches KV events over HTTP: --events must be the engine's "
                f"POST /kv_cache_events URL (or left out for {self.engine_root}/kv_cache_events), got {self.events!r}"
            )
        if not polled and ("://" not in self.events or self.events.startswith(("http://", "https://"))):
            raise ValueError(f"--events must be a ZMQ endpoint like tcp://host:5557, got {self.events!r}")

    @property
    def polled(self) -> bool:
        """Whether the engine's KV events are polled over HTTP (--engine-kind trtllm), not subscribed to."""
        return self.engine_kind == TRTLLM

    @property
    def events_source(self) -> str:
        """Where the events come from: the polled URL, or the ZMQ endpoint."""
        return self.events_url if self.polled or self.events is None else self.events

    @property
    def events_url(self) -> str:
        """Where a TensorRT-LLM engine's KV events are polled."""
        if self.events is not None and self.events.startswith(("http://", "https://")):
            return self.events
        return f"{self.engine_root}/kv_cache_events"

    @property
    def engine_root(self) -> str:
        return root_url(self.engine_url)

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{self.engine_root}#{self.dp_rank}"


_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--engine-url", str, "the engine's OpenAI base URL, where routers send requests"),
    (
        "--events",
        str,
        "the engine's ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557 (TensorRT-LLM: its POST /kv_cache_events URL, "
        "by default <engine>/kv_cache_events)",
    ),
    ("--replay", str, "the engine's ZMQ replay (ROUTER) endpoint, e.g. tcp://127.0.0.1:5558"),
    ("--topic", str, 'the KV-event topic (default "")'),
    ("--model", str, "served model name (default: ask the engine's /v1/models)"),
    (
        "--engine-kind",
        str,
        "the engine: vllm, sglang or trtllm; its KV-event dialect and metric names "
        "(default: the owned_by of its /v1/models, else vllm; trtllm must be named: its events are polled "
        "over HTTP)",
    ),
    (
        "--block-size",
        int,
        "tokens per index block (default: vLLM's /metrics, else its first event; 16 for SGLang, whose pages are "
        "re-blocked into the index's blocks)",
    ),
    ("--dp-rank", int, "data-parallel rank this agent follows (default 0)"),
    ("--worker-id", str, "worker id in the index (default <engine url>#<rank>)"),
    ("--metrics-port", int, "port for /health and /metrics (default 0: off)"),
    ("--metrics-host", str, "address for /health and /metrics (default 127.0.0.1; 0.0.0.0 for a scraper elsewhere)"),
    ("--tiers", str, "cache tiers to index, of GPU,CPU,DISK,REMOTE (default all the engine reports; GPU always)"),
    ("--role", str, "the worker's part in a prefill/decode split: both, prefill or decode (default both)"),
    (
        "--kv-transfer-config",
        str,
        "the engine's --kv-transfer-config JSON: its kv_role gives the role when --role is not given "
        "(kv_producer: prefill, kv_consumer: decode, kv_both: both)",
    ),
    (
        "--events-warn-after",
        float,
        "seconds the engine may serve requests with no KV event arriving before the agent warns "
        "(a wrong --events or --topic; default 30, 0: never)",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, kind, help_text in _FLAGS:
        variable = ENV_VARS[flag[2:].replace("-", "_")]
        parser.add_argument(flag, type=kind, help=f"{help_text}; env {variable}")
    parser.add_argument(
        "--events-bind",
        action="store_true",
        default=None,
        help="listen on a wildcard --events endpoint (tcp://*:5557) for an engine told to connect to this agent; "
        "off by default: a bound socket takes events from any publisher; env KVROUTE_EVENTS_BIND",
    )
    add_redis_arguments(parser)
    parser.add_argument("--ttl-ms", type=int, help="heartbeat TTL in ms (default 5000)")
    parser.add_argument("--reassert-interval", type=float, help="seconds between full re-asserts (default 3600)")
    parser.add_argument("--verify-interval", type=float, help="seconds between block-count checks (default 5)")
    parser.add_argument(
        "--replay-deadline", type=float, help="seconds one replay from the engine may take in all (default 5)"
    )
    parser.add_argument(
        "--max-message-bytes", type=int, help="largest KV-event message frame accepted (default 16 MiB)"
    )
    parser.add_argument(
        "--max-queued-messages", type=int, help="KV-event messages held before dropping (default 100000)"
    )
    parser.add_argument("--max-queued-bytes", type=int, help="KV-event bytes held before dropping (default 256 MiB)")
    add_log_arguments(parser)


def _check_engine_kind(kind: object) -> None:
    if kind is not None and kind not in ENGINE_KINDS:
        raise ValueError(f"--engine-kind must be one of {', '.join(ENGINE_KINDS)}, got {kind!r}")


def _is_wildcard(endpoint: str) -> bool:
    """A wildcard host (tcp://*:5557, tcp://[::]:5557, tcp://0.0.0.0:5557): the agent would bind."""
    return "*" in endpoint or "::" in endpoint or "//0.0.0.0:" in endpoint


def _parser(name: str) -> Callable[[str, str], object]:
    """How a setting's KVROUTE_* variable is read (kvservice.options)."""
    if name == "events_bind":
        return parse_switch
    if name == "tiers":
        return lambda variable, text: _tiers(variable, text)
    if name in _INTS:
        return typed(int)
    if name in _FLOATS:
        return typed(float)
    return lambda _, text: text


def _tiers(where: str, text: str) -> frozenset[str]:
    try:
        return parse_tiers(text)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _resolve_role(values: dict[str, object]) -> None:
    """``role`` from --role, else from --kv-transfer-config's kv_role (which is then dropped)."""
    config = values.pop("kv_transfer_config", None)
    if "role" in values or config is None:
        return
    try:
        parsed = json.loads(str(config))
    except ValueError as exc:
        raise ValueError(f"--kv-transfer-config must be JSON, got {str(config)[:80]!r} ({exc})") from None
    kv_role = parsed.get("kv_role") if isinstance(parsed, dict) else None
    if kv_role is None:
        return  # no kv_role: the engine is complete
    try:
        values["role"] = role_of_kv_role(str(kv_role))
    except ValueError as exc:
        raise ValueError(f"--kv-transfer-config: {exc}") from None


def settings_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> AgentSettings:
    """Flags first, then KVROUTE_* variables, then defaults. Raises ValueError with a message
    naming the flag when something is missing or malformed."""
    env = os.environ if env is None else env
    values = flag_or_env(args, env, [(name, variable, _parser(name)) for name, variable in ENV_VARS.items()])
    kind = values.get("engine_kind")
    _check_engine_kind(kind)  # first: it decides what else is required
    required = ("engine_url",) if kind == TRTLLM else ("engine_url", "events")
    missing: Sequence[str] = [f"--{n.replace('_', '-')}" for n in required if n not in values]
    if missing:
        raise ValueError(f"missing required setting(s): {', '.join(missing)} (or their KVROUTE_* variables)")
    if args.ttl_ms is not None:
        values["ttl_ms"] = args.ttl_ms
    if args.reassert_interval is not None:
        values["reassert_interval_s"] = args.reassert_interval
    if args.verify_interval is not None:
        values["verify_interval_s"] = args.verify_interval
    if args.replay_deadline is not None:
        values["replay_deadline_s"] = args.replay_deadline
    for name in ("max_message_bytes", "max_queued_messages", "max_queued_bytes"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if isinstance(values.get("tiers"), str):  # the flag's text
        values["tiers"] = _tiers("--tiers", values["tiers"])
    _resolve_role(values)
    if "events_warn_after" in values:
        values["events_warn_after_s"] = values.pop("events_warn_after")
    values["redis"] = RedisSettings.from_env(
        env, url=args.redis_url, prefix=args.prefix, **redis_security_overrides(args)
    )
    return AgentSettings(**values)  # type: ignore[arg-type]
