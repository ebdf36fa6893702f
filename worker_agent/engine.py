"""The engine's HTTP side as the agent sees it: /health, /metrics (load signal, block size, how
much work it has done, when its process started) and /v1/models. Parsing is pure and tested on the
real server's /metrics capture.

An engine's /metrics is not trusted: a value that is not a finite number in its metric's range
(``+Inf``, ``NaN``, text, a negative count) is reported in :attr:`EngineMetrics.bad` and never used,
and only that metric is lost (its other series too: a partial sum would be wrong). Lines of metrics
the agent does not read are not looked at, so garbage there costs nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvindex.types import WorkerLoad
from worker_agent.engine_kinds import VLLM_METRICS, EngineKind, MetricNames, kind_of_listing
from worker_agent.iteration_stats import parse_iteration_stats, work_done

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
    counters: Mapping[str, float] = field(
        default_factory=dict
    )  # the valid counters, by the engine's names (MetricNames.counters)
    start_time: float | None = None  # process_start_time_seconds, when present and valid
    bad: tuple[BadValue, ...] = ()
    names: MetricNames = VLLM_METRICS

    @property
    def work(self) -> float | None:
        """The sum of the work counters present (prompt tokens, or the engine's own progress counter,
        and finished requests); None when the page has neither."""
        work = (self.names.progress, self.names.finished)
        present = [self.counters[name] for name in work if name in self.counters]
        return sum(present) if present else None

    def computed(self, block_size: int | None) -> ComputedTokens | None:
        """What the engine computed (None: the page lacks a counter it takes, or the block size is unknown)."""
        if block_size is None or not all(name in self.counters for name in self.names.counters):
            return None
        c, n = self.counters, self.names
        tokens = c[n.prompt_tokens] - c[n.cached_tokens] + c[n.generated_tokens]
        in_flight = self.load.running + self.load.waiting if self.load is not None else 0
        return ComputedTokens(tokens, c[n.finished], in_flight, block_size)


def root_url(engine_url: str) -> str:
    """The server's root: routers and the agent append /v1/..., /health, /metrics to it."""
    url = engine_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _problem(name: str, value: float, names: MetricNames) -> str | None:
    """Why ``value`` cannot be a sample of ``name`` (None: it can)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value < 0 and name != names.kv_usage:  # the usage is clamped to 0..1 below
        return f"negative ({value:g})"
    if name in (names.running, names.waiting) and value > MAX_REQUESTS:
        return f"out of range ({value:g})"
    return None


def _name_of(line: str, read: tuple[str, ...]) -> str | None:
    """The metric a sample line is about, when it is one the agent reads."""
    if not line.startswith(read):
        return None
    for name in read:
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ", "\t", ""):
            return name
    return None


class _Page:
    """Sums of one rank's samples of the metrics the agent reads, and what was wrong with them."""

    def __init__(self, dp_rank: int | None, names: MetricNames) -> None:
        self.dp_rank = dp_rank
        self.names = names
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
            rank = sample.labels.get(self.names.rank_label)
            if self.dp_rank is not None and rank is not None and rank != str(self.dp_rank):
                continue
            if name == self.names.cache_config:
                self.block_size = _int_label(sample.labels, "block_size", self.block_size)
                self.capacity = _int_label(sample.labels, "num_gpu_blocks", self.capacity)
                continue
            problem = _problem(name, sample.value, self.names)
            if problem is not None:
                self.spoiled.setdefault(name, problem)
            elif name == self.names.start_time:
                self.sums[name] = max(self.sums.get(name, 0.0), sample.value)
            else:
                self.sums[name] = self.sums.get(name, 0.0) + sample.value

    def valid(self, name: str) -> float | None:
        return None if name in self.spoiled else self.sums.get(name)

    def result(self, block_size: int | None) -> EngineMetrics:
        running, waiting, usage = (self.valid(name) for name in self.names.load)
        capacity = self.capacity
        tokens = self.valid(self.names.capacity_tokens) if self.names.capacity_tokens else None
        if tokens is not None and block_size:  # a cache sized in tokens, in the index's blocks
            capacity = int(tokens) // block_size or None
        load = None
        if running is not None and waiting is not None and usage is not None:
            load = WorkerLoad(int(running), int(waiting), min(max(usage, 0.0), 1.0), capacity)
        counters = {name: value for name in self.names.counters if (value := self.valid(name)) is not None}
        bad = tuple(BadValue(name, reason) for name, reason in self.spoiled.items())
        return EngineMetrics(load, self.block_size, counters, self.valid(self.names.start_time), bad, self.names)


def _unparseable(exc: Exception) -> str:
    detail = " ".join(str(exc).split())
    marker = "convert string to float: "
    if marker in detail:
        return f"not a number: {detail.split(marker, 1)[1][:60]}"
    return f"unparseable ({detail[:80]})"


def parse_metrics(
    text: str, dp_rank: int | None = None, names: MetricNames = VLLM_METRICS, block_size: int | None = None
) -> EngineMetrics:
    """An engine's Prometheus page (``names`` says which engine's) -> load, block size, work
    counters and start time. With data parallelism one server labels each rank's series (vLLM
    ``engine="<rank>"``, SGLang ``dp_rank``); only ``dp_rank``'s count (all when None). A cache
    sized in tokens is counted in ``block_size`` blocks. Never raises: what cannot be used is in
    :attr:`EngineMetrics.bad`."""
    page = _Page(dp_rank, names)
    read = names.read
    for line in text.splitlines():
        name = _name_of(line, read)
        if name is not None:
            page.add_line(name, line)
    return page.result(block_size)


def _int_label(labels: dict[str, str], name: str, default: int | None) -> int | None:
    value = labels.get(name, "")
    if not (value.isascii() and value.isdigit() and len(value) <= 18):
        return default
    return int(value) if int(value) > 0 else default


class EngineClient:
    """HTTP calls to one engine, each bounded by ``timeout_s``."""

    def __init__(self, session: aiohttp.ClientSession, engine_url: str, dp_rank: int, timeout_s: float = 2.0):
        self.session = session  # the agent's other HTTP calls to the engine use it too (worker_agent/poller.py)
        self.root = root_url(engine_url)
        self._dp_rank = dp_rank
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.names = VLLM_METRICS  # its kind's metric names, once the agent knows the kind
        self.iteration_stats = False  # its load is TensorRT-LLM's JSON iteration stats, not Prometheus text
        self._last_usage = 0.0
        self._iterations = self._completed = 0  # what the iteration stats read so far counted

    async def healthy(self) -> bool:
        try:
            async with self.session.get(f"{self.root}/health", timeout=self._timeout) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def metrics(self, block_size: int | None = None) -> EngineMetrics | None:
        """The parsed page (a cache sized in tokens counted in ``block_size`` blocks); None when
        the engine does not answer with one."""
        try:
            async with self.session.get(f"{self.root}/metrics", timeout=self._timeout) as response:
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
        if self.iteration_stats:
            return self._from_iteration_stats(bytes(body), block_size)
        return parse_metrics(body.decode("utf-8", errors="replace"), self._dp_rank, self.names, block_size)

    def use_kind(self, kind: EngineKind) -> None:
        """Read the metrics of ``kind``'s engine (its names, or TensorRT-LLM's iteration stats)."""
        self.names = kind.metrics
        self.iteration_stats = kind.iteration_stats

    def _from_iteration_stats(self, body: bytes, block_size: int | None) -> EngineMetrics:
        try:
            stats = json.loads(body)
        except (ValueError, RecursionError):
            return EngineMetrics(None, None, bad=(BadValue("/metrics", "not JSON"),))
        load, problem = parse_iteration_stats(stats, block_size, self._last_usage)
        if load is None:
            return EngineMetrics(None, None, bad=(BadValue("/metrics", problem),))
        self._last_usage = load.kv_usage
        iterations, completed = work_done(stats)
        self._iterations += iterations
        self._completed += completed
        counters = {self.names.progress: float(self._iterations), self.names.finished: float(self._completed)}
        return EngineMetrics(load, None, counters, names=self.names)

    async def served_models(self) -> ServedModels | None:
        """/v1/models, parsed; None when the engine does not answer with a listing."""
        try:
            async with self.session.get(f"{self.root}/v1/models", timeout=self._timeout) as response:
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
    engine_kind: str | None = None  # the kind of engine its entries' owned_by names (vllm, sglang)

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
    return ServedModels(tuple(bases), adapters, lengths, kind_of_listing(body))
