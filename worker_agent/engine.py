"""The engine's HTTP side as the agent sees it: /health, /metrics (load signal, block size, how
much work it has done, when its process started) and /v1/models. Parsing is pure and tested on the
real server's /metrics capture.

An engine's /metrics is not trusted: a value that is not a finite number in its metric's range
(``+Inf``, ``NaN``, text, a negative count) is reported in :attr:`EngineMetrics.bad` and never used,
and only that metric is lost (its other series too: a partial sum would be wrong). Lines of metrics
the agent does not read are not looked at, so garbage there costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvindex.types import WorkerLoad

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
# prometheus_client's process collector (vLLM's API server has it): a new value is a new process.
START_TIME = "process_start_time_seconds"
# Counters that grow as the engine serves requests (so its KV events should be arriving); one
# that goes back means a new process.
WORK_COUNTERS = ("vllm:prompt_tokens_total", "vllm:request_success_total")
# What the engine computed rather than found cached: new KV blocks, so KV events, come only from these.
PROMPT_TOKENS, FINISHED = WORK_COUNTERS
CACHED_TOKENS, GENERATED_TOKENS = "vllm:prompt_tokens_cached_total", "vllm:generation_tokens_total"
LOAD_GAUGES = (RUNNING, WAITING, KV_USAGE)
READ = (*LOAD_GAUGES, CACHE_CONFIG, START_TIME, *WORK_COUNTERS, CACHED_TOKENS, GENERATED_TOKENS)
MAX_REQUESTS = 2**31  # more running or waiting requests than any engine holds: garbage
MAX_PAGE_BYTES = 16 << 20  # vLLM's page is ~50 KB; a bigger answer is not a metrics page


@dataclass(frozen=True)
class BadValue:
    metric: str
    reason: str  # one line: "+Inf", "NaN", "not a number: 'lots'", "negative (-3)", ...


@dataclass(frozen=True)
class ComputedTokens:
    """The engine's computed tokens (prompt tokens not found cached, and generated ones: what new
    KV blocks are made of), the requests it finished (both counters, so far), the requests in
    flight now, and its block size."""

    tokens: float
    finished: float
    in_flight: int
    block_size: int


@dataclass(frozen=True)
class EngineMetrics:
    load: WorkerLoad | None  # None when the page lacks (valid) load gauges
    block_size: int | None  # from vllm:cache_config_info, when present
    counters: Mapping[str, float] = field(default_factory=dict)  # the valid counters (WORK_COUNTERS and more)
    start_time: float | None = None  # process_start_time_seconds, when present and valid
    bad: tuple[BadValue, ...] = ()

    @property
    def work(self) -> float | None:
        """The sum of the WORK_COUNTERS present; None when the page has none."""
        present = [self.counters[name] for name in WORK_COUNTERS if name in self.counters]
        return sum(present) if present else None

    def computed(self, block_size: int | None) -> ComputedTokens | None:
        """What the engine computed (None: the page lacks a counter it takes, or the block size is unknown)."""
        names = (PROMPT_TOKENS, CACHED_TOKENS, GENERATED_TOKENS, FINISHED)
        if block_size is None or not all(name in self.counters for name in names):
            return None
        c = self.counters
        tokens = c[PROMPT_TOKENS] - c[CACHED_TOKENS] + c[GENERATED_TOKENS]
        in_flight = self.load.running + self.load.waiting if self.load is not None else 0
        return ComputedTokens(tokens, c[FINISHED], in_flight, block_size)


def root_url(engine_url: str) -> str:
    """The server's root: routers and the agent append /v1/..., /health, /metrics to it."""
    url = engine_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _problem(name: str, value: float) -> str | None:
    """Why ``value`` cannot be a sample of ``name`` (None: it can)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value < 0 and name != KV_USAGE:  # the usage is clamped to 0..1 below
        return f"negative ({value:g})"
    if name in (RUNNING, WAITING) and value > MAX_REQUESTS:
        return f"out of range ({value:g})"
    return None


def _name_of(line: str) -> str | None:
    """The metric a sample line is about, when it is one the agent reads."""
    if not line.startswith(READ):
        return None
    for name in READ:
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ", "\t", ""):
            return name
    return None


class _Page:
    """Sums of one rank's samples of the metrics in READ, and what was wrong with them."""

    def __init__(self, dp_rank: int | None) -> None:
        self.dp_rank = dp_rank
        self.sums: dict[str, float] = {}
        self.spoiled: dict[str, str] = {}  # metric -> the first reason
        self.block_size: int | None = None
        self.capacity: int | None = None

    def add_line(self, name: str, line: str) -> None:
        try:
            samples = [s for family in text_string_to_metric_families(line + "\n") for s in family.samples]
        except Exception as exc:  # the parser's errors are ValueError, but a page is untrusted input
            self.spoiled.setdefault(name, _unparseable(exc))
            return
        for sample in samples:
            engine = sample.labels.get("engine")
            if self.dp_rank is not None and engine is not None and engine != str(self.dp_rank):
                continue
            if name == CACHE_CONFIG:
                self.block_size = _int_label(sample.labels, "block_size", self.block_size)
                self.capacity = _int_label(sample.labels, "num_gpu_blocks", self.capacity)
                continue
            problem = _problem(name, sample.value)
            if problem is not None:
                self.spoiled.setdefault(name, problem)
            elif name == START_TIME:
                self.sums[name] = max(self.sums.get(name, 0.0), sample.value)
            else:
                self.sums[name] = self.sums.get(name, 0.0) + sample.value

    def valid(self, name: str) -> float | None:
        return None if name in self.spoiled else self.sums.get(name)

    def result(self) -> EngineMetrics:
        running, waiting, usage = (self.valid(name) for name in LOAD_GAUGES)
        load = None
        if running is not None and waiting is not None and usage is not None:
            load = WorkerLoad(int(running), int(waiting), min(max(usage, 0.0), 1.0), self.capacity)
        counted = (*WORK_COUNTERS, CACHED_TOKENS, GENERATED_TOKENS)
        counters = {name: value for name in counted if (value := self.valid(name)) is not None}
        bad = tuple(BadValue(name, reason) for name, reason in self.spoiled.items())
        return EngineMetrics(load, self.block_size, counters, self.valid(START_TIME), bad)


def _unparseable(exc: Exception) -> str:
    detail = " ".join(str(exc).split())
    marker = "convert string to float: "
    if marker in detail:
        return f"not a number: {detail.split(marker, 1)[1][:60]}"
    return f"unparseable ({detail[:80]})"


def parse_metrics(text: str, dp_rank: int | None = None) -> EngineMetrics:
    """vLLM's Prometheus page -> load, block size, work counters and start time. With data
    parallelism one server labels each rank's series ``engine="<rank>"``; only ``dp_rank``'s count
    (all when None). Never raises: what cannot be used is in :attr:`EngineMetrics.bad`."""
    page = _Page(dp_rank)
    for line in text.splitlines():
        name = _name_of(line)
        if name is not None:
            page.add_line(name, line)
    return page.result()


def _int_label(labels: dict[str, str], name: str, default: int | None) -> int | None:
    value = labels.get(name, "")
    if not (value.isascii() and value.isdigit() and len(value) <= 18):
        return default
    return int(value) if int(value) > 0 else default


class EngineClient:
    """HTTP calls to one engine, each bounded by ``timeout_s``."""

    def __init__(self, session: aiohttp.ClientSession, engine_url: str, dp_rank: int, timeout_s: float = 2.0):
        self._session = session
        self.root = root_url(engine_url)
        self._dp_rank = dp_rank
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def healthy(self) -> bool:
        try:
            async with self._session.get(f"{self.root}/health", timeout=self._timeout) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def metrics(self) -> EngineMetrics | None:
        """The parsed page; None when the engine does not answer with one."""
        try:
            async with self._session.get(f"{self.root}/metrics", timeout=self._timeout) as response:
                if response.status != 200:
                    return None
                body = bytearray()
                async for chunk in response.content.iter_any():
                    body += chunk
                    if len(body) > MAX_PAGE_BYTES:
                        break
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None
        if len(body) > MAX_PAGE_BYTES:
            return EngineMetrics(None, None, bad=(BadValue("/metrics", f"the page is over {MAX_PAGE_BYTES} bytes"),))
        return parse_metrics(body.decode("utf-8", errors="replace"), self._dp_rank)

    async def served_models(self) -> ServedModels | None:
        """/v1/models, parsed; None when the engine does not answer with a listing."""
        try:
            async with self._session.get(f"{self.root}/v1/models", timeout=self._timeout) as response:
                if response.status != 200:
                    return None
                body = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return None
        return parse_models(body)


@dataclass(frozen=True)
class ServedModels:
    """What an engine's /v1/models lists: its base models, and its LoRA adapters by the base model
    each applies to (vLLM lists an adapter with ``parent``, the base model's name)."""

    bases: tuple[str, ...] = ()
    adapters: Mapping[str, str] = field(default_factory=dict)  # adapter -> its base model
    # base model -> its context length, where the listing says (vLLM's model card: max_model_len)
    max_model_len: Mapping[str, int] = field(default_factory=dict)

    def adapters_of(self, base: str) -> tuple[str, ...]:
        return tuple(sorted(name for name, parent in self.adapters.items() if parent == base))


def parse_models(body: object) -> ServedModels:
    """An OpenAI model listing -> :class:`ServedModels`. Entries without a string ``id`` are left
    out; an entry with a string ``parent`` is an adapter (vLLM's LoRA modules), any other a base
    model. An adapter whose name is not one line is left out (the index keeps one per line). A
    base model's ``max_model_len`` is kept where it is a positive integer."""
    data = body.get("data") if isinstance(body, dict) else None
    bases: list[str] = []
    adapters: dict[str, str] = {}
    lengths: dict[str, int] = {}
    for entry in data if isinstance(data, list) else []:
        name = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name:
            continue
        parent = entry.get("parent")
        if isinstance(parent, str) and parent and parent != name:
            if "\n" not in name:
                adapters[name] = parent
        else:
            bases.append(name)
            length = entry.get("max_model_len")
            if isinstance(length, int) and not isinstance(length, bool) and 0 < length < 1 << 40:
                lengths[name] = length
    return ServedModels(tuple(bases), adapters, lengths)
