"""Which worker gets a request: pure functions over what the index and the shared load say.

The cost of sending a prompt to a worker is the time to its first token there, predicted:

    base + per_context * (attention work of own prefill and prefill ahead: N * (P + N / 2) / 1000
                          for N new tokens after P computed; a long context's miss costs more)
         + per_token * ( own prefill        uncached tokens of this prompt on that worker, counted
                                             1 + (requests it will delay there: those queued
                                             there, and those arriving while it is computed)
                                             times (see :func:`requests_behind`)
                       + prefill ahead       uncached tokens queued there before it (booked by every
                                             replica and not yet at their first byte, or what the
                                             engine says it queues, whichever is more), less the part
                                             that computes this very prompt's prefix (shared work)
                       + reuse * evicted )   tokens of other prefixes its new blocks would evict there
                                             when that cache is full, each re-prefilled later with
                                             the probability ``reuse``

``base`` and ``per_token`` are learned per worker from observed first-byte times
(:mod:`router.routing.ttft`); ``reuse`` is the measured share of prompt tokens served from cache. The
weights (all 1 but the legacy ``active`` and ``queue`` terms, 0) stay as advanced overrides. A
worker whose KV cache is nearly full or whose queue is long is "busy" and is only chosen when all
are busy (the ranking itself: :mod:`router.routing.choice`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvindex.shared_load import InflightLoad
from kvindex.tiers import LOWER_TIERS
from kvindex.types import WorkerLoad
from kvservice.declared import nested, of_type, setting
from router.routing.tiers import TierCosts, TierMode, loadable
from router.routing.ttft import CostModel
from router.routing.ttft_fit import attention_work

NO_LOAD = InflightLoad()
NO_TIER_COSTS = TierCosts()
MAX_CONGESTION = 8.0
MAX_UTILIZATION = 0.9  # beyond this the queueing estimate explodes; MAX_CONGESTION caps it anyway
MAX_OWN_DELAYED = 1.0  # arrivals a prefill delays while it is computed (requests_behind)
OVERRIDES = "scoring overrides"  # the --help section of the weights


class Policy(StrEnum):
    KV = "kv"
    PREFIX = "prefix"  # the longest match wins; ties go to the least loaded
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOADED = "least_loaded"


@dataclass(frozen=True)
class ScoringWeights:
    """Advanced overrides of the cost's terms; the cost is a predicted TTFT, learned online, and needs
    no tuning (docs/router.md, "How a worker is chosen")."""

    prefill: float = setting(
        1.0, flag="--weight-prefill", parse=of_type(float), group=OVERRIDES, help="per own uncached token"
    )
    queued: float = setting(
        1.0,
        flag="--weight-queued",
        parse=of_type(float),
        group=OVERRIDES,
        help="per uncached token queued ahead (0: load ignored, the longest match wins)",
    )
    # per in-flight prompt token (KV held there): off, time does not depend on it
    active: float = setting(
        0.0,
        flag="--weight-active",
        parse=of_type(float),
        group=OVERRIDES,
        help="per in-flight prompt token (legacy: time does not depend on it)",
    )
    queue: float = setting(
        0.0,
        flag="--weight-queue",
        parse=of_type(float),
        group=OVERRIDES,
        help="extra per request the engine queues, on top of the prefill ahead (legacy)",
    )
    busy_kv_usage: float = setting(
        0.97,
        flag="--busy-kv-usage",
        parse=of_type(float),
        group=OVERRIDES,
        help="a worker at or above this KV-cache usage is busy: chosen only if all are",
    )
    busy_waiting: int = setting(
        16,
        flag="--busy-waiting",
        parse=of_type(int),
        group=OVERRIDES,
        help="a worker with this many requests waiting is busy: chosen only if all are",
    )
    temperature: float = setting(
        0.0,
        flag="--temperature",
        parse=of_type(float),
        group=OVERRIDES,
        help="0: the lowest cost wins; above 0: softmax sampling over the costs",
    )
    cache_pressure: float | None = setting(
        None,
        flag="--weight-cache-pressure",
        parse=of_type(float),
        group=OVERRIDES,
        shown_default="the measured cache hit rate",
        help="per token a prefill would evict from a full cache, re-prefilled later with this probability",
    )
    tiers: TierCosts = nested(TierCosts)  # what a lower cache tier's blocks are worth

    def __post_init__(self) -> None:
        if min(self.prefill, self.queued, self.active, self.queue, self.temperature) < 0:
            raise ValueError("scoring weights and the temperature must be >= 0")
        if self.cache_pressure is not None and self.cache_pressure < 0:
            raise ValueError("the cache-pressure weight must be >= 0")
        if not 0 < self.busy_kv_usage <= 1 or self.busy_waiting < 1:
            raise ValueError("busy_kv_usage must be in (0, 1] and busy_waiting >= 1")


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    url: str
    matched_blocks: int = 0
    inflight: InflightLoad = NO_LOAD
    engine: WorkerLoad | None = None
    pending_blocks: int = 0  # of matched_blocks, those requests in flight there are prefilling now
    cached_blocks: int | None = None  # blocks the index lists for that worker (its cache's content)
    held_blocks: int = 0  # leading blocks of this prompt that requests in flight there compute or hold
    idle_s: float | None = None  # since it was last seen busy (None: not seen busy since this replica started)
    tier_depths: tuple[int, ...] = ()  # its lower tiers' prefix depths (kvindex.tiers.LOWER_TIERS order)


@dataclass(frozen=True)
class Scored:
    candidate: Candidate
    cost: float  # seconds: the predicted TTFT plus the cost of the cache pressure
    busy: bool
    prefill_tokens: float = 0.0  # the prefill it would wait for there (ahead + own): what TTFT is fitted on
    ttft_s: float = 0.0  # the predicted time to first token there
    hit_blocks: int = 0  # blocks the engine will not compute: its GPU's that survive, and those loaded
    loaded: tuple[int, ...] = ()  # of them, those each lower tier loads (kvindex.tiers.LOWER_TIERS order)
    attention: float = 0.0  # the attention work of that prefill (ahead + own; router.routing.ttft_fit.attention_work)
    own_attention: float = 0.0  # of it, its own prefill's (booked there with it)
    priced_load: bool = False  # its loads were priced in time: its TTFT can teach their time
    ahead_tokens: float = 0.0  # the prefill it would wait behind there (router.routing.trade_check)

    @property
    def single_tier_load(self) -> tuple[str, int] | None:
        """(tier, blocks) when it loads from one lower tier and its loads were priced in time:
        what its TTFT teaches (router.routing.tier_load)."""
        loads = [(tier, n) for tier, n in zip(LOWER_TIERS, self.loaded, strict=False) if n]
        return loads[0] if self.priced_load and len(loads) == 1 else None

    @property
    def loaded_blocks(self) -> int:
        return sum(self.loaded)


def predicted_cached_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Cached tokens as vLLM counts them: whole blocks, at most prompt length - 1."""
    if prompt_tokens <= 0:
        return 0
    return min(matched_blocks * block_size, (prompt_tokens - 1) // block_size * block_size)


def surviving_blocks(candidate: Candidate, block_size: int) -> int:
    """How many of ``candidate``'s matched blocks will still be cached when the engine schedules
    this prompt there: the index says what the cache holds now, not what the requests in flight
    there will have evicted by then.

    A request is scheduled once those ahead of it are (first come, first served), and each holds
    its whole prompt while it runs; vLLM evicts the least recently used free blocks to make room
    for them. So the matched blocks that requests in flight there hold themselves (the same
    prefix: pinned) survive, and of the others at most what the cache has room for beside the
    prompts in flight: ``capacity - 1 - (their blocks)``. Taken as the most recently used (the
    match of a conversation's last turn usually is), they are the last to go. A cache whose size
    is not known, or with room for everything, keeps the whole match.

    Prompts in flight that share a prefix share its blocks, so their summed length overstates
    what they hold (fifty requests on one 3k-token system prompt hold it once). Where the sum is
    more than the cache holds at all, it is bounded by the engine's own KV usage (the blocks
    running requests hold, as its agent last scraped it: up to a second or so old) plus the
    prefill still to come (booked uncached tokens: blocks not allocated yet). Below that, the sum
    stands: a usage scraped before the last requests were admitted would say the cache is free."""
    matched = candidate.matched_blocks
    engine = candidate.engine
    capacity = engine.capacity_blocks if engine else None
    inflight = candidate.inflight
    if not capacity or engine is None or matched <= 0 or inflight.requests <= 0:
        return matched
    pinned = min(matched, candidate.held_blocks)
    # blocks of the prompts in flight there (each one's last block partly filled), null block aside
    held = inflight.prompt_tokens // block_size + inflight.requests
    if held >= capacity:  # certainly shared blocks counted more than once
        # (the usage counts the running requests' partly filled blocks already)
        used = round(engine.kv_usage * capacity) + -(-inflight.uncached_tokens // block_size)
        held = min(held, used)
    room = capacity - 1 - held
    return pinned + min(matched - pinned, max(room, 0))


@dataclass(frozen=True)
class Terms:
    """A candidate's cost terms, in tokens (see the module's docstring); ``hit_blocks`` the
    matched blocks predicted to survive until it is scheduled (:func:`surviving_blocks`)."""

    own: float
    ahead: float
    evicted: float
    hit_blocks: int = 0
    own_attention: float = 0.0  # its own prefill's attention work: own tokens after the hit ones
    ahead_attention: float = 0.0  # the prefill ahead's, as booked
    loaded: tuple[int, ...] = ()  # blocks each lower tier loads past the GPU's hit (router.routing.tiers)
    load_s: float = 0.0  # the time those loads take


def terms(
    candidate: Candidate, prompt_blocks: int, block_size: int, model: CostModel, tiers: TierCosts | None = None
) -> Terms:
    tiers = tiers or NO_TIER_COSTS
    hit_blocks = min(surviving_blocks(candidate, block_size), prompt_blocks)
    loaded: tuple[int, ...] = ()
    if tiers.mode is not TierMode.IGNORE:
        loaded = loadable(candidate.tier_depths, hit_blocks, prompt_blocks)
    own_blocks = max(prompt_blocks - hit_blocks - sum(loaded), 0)
    load_s, credited = 0.0, float(sum(loaded))
    if tiers.mode is TierMode.TIME:
        load_s = sum(n * block_size * tiers.load_s_per_token(t) for t, n in zip(LOWER_TIERS, loaded, strict=False))
    elif tiers.mode is TierMode.LEARNED:  # as TTFTs taught (the flags' values for a tier not loaded from yet)
        load_s = sum(
            _learned_load_s(model, tiers, t, n * block_size) for t, n in zip(LOWER_TIERS, loaded, strict=False)
        )
    elif tiers.mode is TierMode.WEIGHTS:  # a loaded block counts as cached by its weight, the rest computed
        credited = sum(n * tiers.weight(t) for t, n in zip(LOWER_TIERS, loaded, strict=False))
    # Prefill queued there delays this prompt, except the part that computes this prompt's own
    # prefix (a burst of one prompt shares that work instead of queueing behind it).
    booked_ahead = max(candidate.inflight.uncached_tokens - candidate.pending_blocks * block_size, 0)
    engine = candidate.engine
    engine_ahead = engine.waiting * model.typical_uncached_tokens if engine else 0.0
    evicted_blocks = 0
    capacity = engine.capacity_blocks if engine else None
    if capacity and candidate.cached_blocks is not None:
        filling = candidate.inflight.uncached_tokens // block_size  # being computed: cached soon
        free = max(capacity - candidate.cached_blocks - filling, 0)
        evicted_blocks = max(own_blocks + sum(loaded) - free, 0)  # a loaded block takes GPU room too
    own = (own_blocks + sum(loaded) - credited) * block_size
    uncached_ahead = candidate.inflight.uncached_tokens
    # the booked attention, less the share of the shared prefix's prefill (as the tokens ahead)
    ahead_attention = candidate.inflight.attention * booked_ahead / uncached_ahead if uncached_ahead > 0 else 0.0
    own_attention = attention_work(own, (prompt_blocks * block_size - own) if own > 0 else 0)
    ahead = max(booked_ahead, engine_ahead)
    evicted = evicted_blocks * block_size
    return Terms(own, ahead, evicted, hit_blocks, own_attention, ahead_attention, loaded, load_s)


def _learned_load_s(model: CostModel, tiers: TierCosts, tier: str, tokens: int) -> float:
    learned = model.tier_load(tier)
    return learned.seconds(tokens) if learned is not None else tokens * tiers.load_s_per_token(tier)


def queued_requests(ahead_tokens: float, model: CostModel) -> float:
    """How many typical requests ``ahead_tokens`` of queued prefill stand for (capped: beyond
    that the worker is saturated and its queue, not a cache, decides)."""
    return min(ahead_tokens / max(model.typical_uncached_tokens, 1.0), MAX_CONGESTION)


def requests_behind(ahead_tokens: float, model: CostModel, own_tokens: float = 0.0) -> float:
    """How many later requests a prefill of ``own_tokens`` added behind ``ahead_tokens`` of queued
    prefill will delay on that worker.

    Those that arrive while the queue ahead drains: about as many as queue there now (the queue's
    length predicts the next), scaled by the fleet's load. A queue at utilization u drains
    ``u / (1 - u)`` times as slowly as one at one half, so that many more arrive before it does:
    at light load a briefly busy worker keeps its conversation; at heavy load every token of
    prefill a cache hit saves is worth many waits. Capped: beyond that the worker is saturated
    and its queue decides.

    And those that arrive while the prefill itself is computed, half of it ahead of each on
    average (the busy period a queue's arithmetic adds for it): this is what makes a long miss on
    an idle worker cost more than its own length in a busy fleet, where such a worker does not
    stay idle. At most one request: the routers see the booked prefill and send later arrivals
    elsewhere when that is cheaper, and a long hot prefix copied to a second worker serves hits
    there afterwards (counted in full, it would be herded onto its holder until the holder's
    queue was nine times the prefix)."""
    utilization = min(max(model.utilization, 0.0), MAX_UTILIZATION)
    congestion = utilization / (1 - utilization)
    queued = min(congestion * queued_requests(ahead_tokens, model), MAX_CONGESTION)
    while_computed = congestion * own_tokens / 2 / max(model.typical_uncached_tokens, 1.0)
    return queued + min(while_computed, MAX_OWN_DELAYED)


def busy_share(candidates: Sequence[Candidate]) -> float:
    """The share of ``candidates`` with prefill queued (booked by a router or waiting in the engine)."""
    if not candidates:
        return 0.0
    busy = sum(1 for c in candidates if c.inflight.uncached_tokens > 0 or (c.engine and c.engine.waiting > 0))
    return busy / len(candidates)


def score(
    candidate: Candidate,
    prompt_blocks: int,
    block_size: int,
    weights: ScoringWeights,
    model: CostModel,
    marginal: bool = True,
) -> Scored:
    """The prefill a request adds on a worker delays the requests that will queue behind it there
    too (:func:`requests_behind`): with ``marginal`` its own prefill counts ``1 +`` that many
    times. On a worker with a long queue every token it adds is paid again by those behind it.
    This is what spreads a hot prefix before its holder's queue eats the prefix's worth (the
    greedy equilibrium) and what keeps prompts on their caches when every worker is busy
    (moving one re-prefills its prefix in front of others); at light load, where few requests
    will wait behind it, a briefly busy worker keeps its conversation."""
    t = terms(candidate, prompt_blocks, block_size, model, weights.tiers)
    params = model.params(candidate.worker_id)
    waiting = candidate.engine.waiting if candidate.engine else 0
    extra = weights.active * candidate.inflight.prompt_tokens + weights.queue * waiting * model.typical_uncached_tokens
    reuse = model.reuse if weights.cache_pressure is None else weights.cache_pressure
    attention = weights.prefill * t.own_attention + weights.queued * t.ahead_attention
    ttft = params.seconds(weights.prefill * t.own + weights.queued * t.ahead + extra, attention) + t.load_s
    behind = requests_behind(t.ahead, model, t.own) if marginal else 0.0
    own_s = params.per_token_s * t.own + params.per_context_s * t.own_attention  # its own prefill's time
    # What the queue costs, at the price measured for it (router.routing.trade_check): the wait
    # ahead and the delay it adds behind; 1: a queued token costs what one's own does.
    queue_s = ttft - params.seconds(weights.prefill * t.own, weights.prefill * t.own_attention) - t.load_s
    load_s = model.queue_weight * (queue_s + behind * weights.prefill * own_s)
    cost = ttft - queue_s + load_s + params.per_token_s * reuse * t.evicted
    own_attention, waited_attention = t.own_attention, t.own_attention + t.ahead_attention
    busy = is_busy(candidate, weights)
    return Scored(
        candidate,
        cost,  # the load time is in the ttft
        busy,
        prefill_tokens=t.own + t.ahead,
        ttft_s=ttft,
        hit_blocks=t.hit_blocks + sum(t.loaded),
        loaded=t.loaded,
        attention=waited_attention,
        own_attention=own_attention,
        priced_load=weights.tiers.mode in (TierMode.TIME, TierMode.LEARNED),
        ahead_tokens=t.ahead,
    )


def cost(
    candidate: Candidate,
    prompt_blocks: int,
    block_size: int,
    weights: ScoringWeights,
    model: CostModel | None = None,
    marginal: bool = True,
) -> float:
    return score(candidate, prompt_blocks, block_size, weights, model or CostModel(), marginal).cost


def is_busy(candidate: Candidate, weights: ScoringWeights) -> bool:
    engine = candidate.engine
    return engine is not None and (engine.kv_usage >= weights.busy_kv_usage or engine.waiting >= weights.busy_waiting)
