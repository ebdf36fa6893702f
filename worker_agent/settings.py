"""The agent's settings: one frozen dataclass whose fields declare their flags and KVROUTE_*
variables (kvservice.declared); argparse, the environment's reading and docs/agent.md's table
are made from it."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvindex.roles import BOTH, ROLES, role_of_kv_role
from kvindex.settings import RedisSettings
from kvindex.tiers import TIERS, parse_tiers
from kvservice.declared import Kind, add_declared, nested, of_type, read_declared, setting
from kvservice.logs import LogSettings
from worker_agent.engine import root_url
from worker_agent.engine_kinds import ENGINE_KINDS, TRTLLM


@dataclass(frozen=True)
class AgentSettings:
    engine_url: str = setting(
        flag="--engine-url",
        metavar="URL",
        help="the engine's OpenAI base URL, where routers send requests; a trailing /v1 is dropped: the index stores "
        "the server root and routers append /v1/...",
    )
    # a ZMQ endpoint; for TensorRT-LLM an http(s) URL it is polled at, or None: the engine's /kv_cache_events
    events: str | None = setting(
        None,
        flag="--events",
        metavar="ENDPOINT",
        shown_default="required (TensorRT-LLM: <engine>/kv_cache_events)",
        help="the engine's ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557: the agent connects to tcp://host:port (vLLM "
        "binds tcp://*:port), and binds a wildcard one with --events-bind. TensorRT-LLM: its POST /kv_cache_events "
        "URL",
    )
    redis: RedisSettings = nested(RedisSettings)
    replay: str | None = setting(
        None,
        flag="--replay",
        metavar="ENDPOINT",
        help="the engine's ZMQ replay (ROUTER) endpoint on the engine's host, e.g. tcp://127.0.0.1:5558 (a * host is "
        "refused); without it, gaps cannot be repaired",
    )
    topic: str = setting("", flag="--topic", help="the KV-event topic (a ZMQ prefix match)")
    model: str | None = setting(
        None, flag="--model", shown_default="the engine's /v1/models", help="the served model name routers will ask for"
    )  # None: ask the engine's /v1/models
    block_size: int | None = setting(
        None,
        flag="--block-size",
        parse=of_type(int),
        shown_default="vLLM's /metrics, else its first event; 16 for SGLang",
        help="tokens per index block: vLLM's blocks are the index's (stored runs of another size are counted and "
        "skipped); SGLang's pages are re-blocked into it; every worker of a model needs the same one",
    )  # None: the engine's /metrics, else the first BlockStored
    dp_rank: int = setting(
        0,
        flag="--dp-rank",
        parse=of_type(int),
        help="the data-parallel rank (the engine metric label) whose events this agent follows",
    )
    worker_id: str | None = setting(
        None, flag="--worker-id", shown_default="<engine url>#<rank>", help="the worker's id in the index"
    )  # None: "<engine root url>#<dp rank>"
    # as the router's: listening beyond this host is the operator's choice
    metrics_host: str = setting(
        "127.0.0.1",
        flag="--metrics-host",
        help="the address of /health and /metrics (0.0.0.0 for a scraper on another host, as compose.yaml's agents)",
    )
    metrics_port: int = setting(
        0, flag="--metrics-port", parse=of_type(int), shown_default="0 (off)", help="the port of /health and /metrics"
    )  # 0: no HTTP server
    heartbeat_interval_s: float = 1.0
    ttl_ms: int = setting(
        5_000, flag="--ttl-ms", parse=of_type(int), help="the heartbeat's TTL in ms (heartbeats go every second)"
    )
    load_interval_s: float = 0.25
    health_interval_s: float = 1.0
    health_failures: int = 3  # consecutive /health failures that mean the engine is down
    verify_interval_s: float = setting(
        5.0,
        flag="--verify-interval",
        parse=of_type(float),
        help="seconds between checks of the worker's block count in Redis against the agent's mirror",
    )  # compare the index's block count with the mirror
    reassert_interval_s: float = setting(
        3600.0,
        flag="--reassert-interval",
        parse=of_type(float),
        help="seconds between full re-asserts: every block rewritten even when nothing looks wrong, so any drift "
        "heals (each agent starts at a random phase)",
    )
    gc_interval_s: float = 10.0
    replay_timeout_s: float = 2.0  # a replay's idle timeout
    replay_deadline_s: float = setting(
        5.0,
        flag="--replay-deadline",
        parse=of_type(float),
        help="seconds one replay from the engine may take in all, besides its 2 s idle timeout (docs/agent.md, Limits)",
    )
    # Limits on what one engine can make the agent hold (see docs/agent.md, "Limits").
    max_message_bytes: int = setting(
        16 << 20,
        flag="--max-message-bytes",
        parse=of_type(int),
        shown_default="16777216 (16 MiB)",
        help="the largest KV-event frame accepted (ZMQ_MAXMSGSIZE; ~27x a 64k-token step's batch)",
    )
    max_queued_messages: int = setting(
        100_000,
        flag="--max-queued-messages",
        parse=of_type(int),
        help="KV-event messages received and not yet applied, before dropping (vLLM's own send HWM)",
    )
    max_queued_bytes: int = setting(
        256 << 20,
        flag="--max-queued-bytes",
        parse=of_type(int),
        shown_default="268435456 (256 MiB)",
        help="KV-event bytes received and not yet applied, before dropping (a gap)",
    )
    # Warn when the engine keeps serving requests this long with no KV event arriving (0: never).
    events_warn_after_s: float = setting(
        30.0,
        flag="--events-warn-after",
        parse=of_type(float),
        help="seconds the engine may serve requests with no KV event arriving before the agent warns (a wrong "
        "--events or --topic; 0: never)",
    )
    # Listen for KV events on a wildcard --events endpoint (for an engine told to connect to the
    # agent). Off by default: a bound SUB takes events from any publisher that reaches the port.
    events_bind: bool = setting(
        False,
        flag="--events-bind",
        kind=Kind.SWITCH,
        help="allow a wildcard --events (tcp://*:port, tcp://0.0.0.0:port, [::]), which the agent binds, for an engine "
        "told to connect to it. Off by default, so the agent only connects: a bound SUB takes KV events from any "
        "publisher that reaches the port, and whoever can publish there can claim any prefix for this worker",
    )
    # The cache tiers indexed (kvindex/tiers.py): every tier the engine reports, by default.
    tiers: frozenset[str] = setting(
        frozenset(TIERS),
        flag="--tiers",
        metavar="GPU,CPU,DISK,REMOTE",
        parse=lambda where, text: _tiers(where, text),
        shown_default="all the engine reports",
        help="the cache tiers to index (the GPU's always; docs/router.md, Cache tiers)",
    )
    # Its part in a prefill/decode split (kvindex/roles.py): --role, else the kv_role of the
    # engine's --kv-transfer-config, else both (resolved in __post_init__).
    role: str = setting(
        None,
        flag="--role",
        choices=ROLES,
        shown_default="--kv-transfer-config's kv_role, else both",
        help="the worker's part in a prefill/decode split (docs/router.md, Prefill/decode fleets)",
    )
    engine_role: str | None = setting(
        None,
        flag="--kv-transfer-config",
        metavar="JSON",
        parse=lambda where, text: _role_of_config(where, text),
        shown_default="none",
        help="the engine's --kv-transfer-config: its kv_role gives the role when --role is not given "
        "(kv_producer: prefill, kv_consumer: decode, kv_both: both)",
    )
    # vllm, sglang or trtllm (worker_agent/engine_kinds.py); None: what the engine's /v1/models says, else vllm
    engine_kind: str | None = setting(
        None,
        flag="--engine-kind",
        parse=lambda where, text: _engine_kind(where, text),
        choices=ENGINE_KINDS,
        shown_default="the owned_by of its /v1/models, else vllm",
        help="the engine: its KV-event dialect, transport and metric names (Engine kinds, below); trtllm must be named "
        "(its events are polled over HTTP), and --events may then be left out",
    )
    log: LogSettings = nested(LogSettings)

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", self.role or self.engine_role or BOTH)
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``kvroute agent``, from :class:`AgentSettings`' declarations."""
    add_declared(parser, AgentSettings)


def _check_engine_kind(kind: object, where: str = "--engine-kind") -> None:
    if kind is not None and kind not in ENGINE_KINDS:
        raise ValueError(f"{where} must be one of {', '.join(ENGINE_KINDS)}, got {kind!r}")


def _engine_kind(where: str, text: str) -> str:
    """Checked as it is read: it decides which other settings are required."""
    _check_engine_kind(text, where)
    return text


def _is_wildcard(endpoint: str) -> bool:
    """A wildcard host (tcp://*:5557, tcp://[::]:5557, tcp://0.0.0.0:5557): the agent would bind."""
    return "*" in endpoint or "::" in endpoint or "//0.0.0.0:" in endpoint


def _tiers(where: str, text: str) -> frozenset[str]:
    try:
        return parse_tiers(text)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _role_of_config(where: str, config: str) -> str | None:
    """The role an engine's --kv-transfer-config gives (its kv_role), None when it names none."""
    try:
        parsed = json.loads(config)
    except ValueError as exc:
        raise ValueError(f"{where} must be JSON, got {config[:80]!r} ({exc})") from None
    kv_role = parsed.get("kv_role") if isinstance(parsed, dict) else None
    if kv_role is None:
        return None  # no kv_role: the engine is complete
    try:
        return role_of_kv_role(str(kv_role))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def settings_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> AgentSettings:
    """Flags first, then KVROUTE_* variables, then defaults (kvservice.declared). Raises ValueError
    with a message naming the flag or variable when something is missing or malformed."""
    return read_declared(AgentSettings, args, os.environ if env is None else env)
