"""The grid of ``kvroute bench regimes`` and the requests of each cell (pure: no processes).

Axes and their values are :data:`AXES`. A cell's requests are multi-turn conversations over tenant
system prompts, in the trace's terms (512-token blocks named by ids, :class:`TraceRequest`), so
that ``bench replay``'s replay loop, text prompts and shared-LRU reference apply unchanged:

* tenants: ``balanced`` 8 tenants used equally; ``hot`` one tenant carries 80% of the requests,
  half of them one-shot requests with a long unique suffix on its prefix (documents, RAG), the
  other 7 tenants share the rest; ``zipf`` 32 tenants whose popularity is Zipf(s=1.1). Each
  tenant has a system prompt of 2-4 blocks (the hot one: 4). ``chat``: 8 tenants' conversations
  written as prose (:mod:`kvroute.bench.regimes_chat`), not in blocks; the rest of this list is
  about the other three.
* conversations: a request is the tenant's system prompt + the conversation so far + a new user
  turn; the first turn adds one block, each later one one or two (the reply and the next user
  message); a conversation has 2-6 turns. ``SLOTS`` conversations are open at any time (users
  chatting at once); each arrival goes to one of them at random, so each conversation's turns
  come at Poisson times, and a turn is never sent before the previous turn's reply has arrived
  (``Workload.after``: the replay holds it until then). A finished conversation's slot starts a
  new one, its tenant drawn so that tenants' request shares follow the axis.
* load: arrivals are Poisson at ``load x capacity / mean prompt tokens`` requests per (simulated)
  second, where capacity = engines x 1,000,000 / prefill ms per 1k tokens, the fleet's prefill
  rate in tokens per second with no cache hit (1000 tokens per engine every prefill-ms-per-1k
  milliseconds). The requests' content does not depend on the load: the load cells of one tenants
  value send the same requests, only faster or slower.

Everything is deterministic per (tenants, seed, count).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace

from kvroute.bench.regimes_chat import chat_conversations
from kvroute.bench.replay_workload import TRACE_BLOCK, TraceRequest
from kvtokens.tokenizer import ModelPrompts
from sim_engine.settings import TINY_MODEL_DIR

AXES: dict[str, tuple[str, ...]] = {
    "tenants": ("balanced", "hot", "zipf", "chat"),
    "load": ("light", "heavy", "overload", "closed"),
    "cache": ("tight", "loose", "tiny", "ample"),
    "client": ("stream", "nostream"),
    "prompts": ("ids", "text"),
    "replicas": ("1", "2", "4"),
    "engine": ("full", "minimal"),
    "prefill": ("serial", "parallel"),
    "tiers": ("gpu", "cpu", "disk"),
    "fleet": ("agg", "pd"),
}
# Open loop, arrivals at these shares of the fleet's prefill capacity; "closed": as many clients as
# engines, each sending its next request when its last is answered (the engines' clock runs as
# for "light"; the arrival times are not used).
LOAD = {"light": 0.3, "heavy": 0.8, "overload": 1.2, "closed": 0.3}
# fleet KV capacity / distinct blocks of the cell's requests; "ample": room for every prefix twice
# over, as decode engines are sized for the sequences they keep running (a P/D fleet's two decode
# engines hold every running sequence)
CACHE = {"tight": 0.25, "loose": 1.0, "ample": 2.0}
TINY_PROMPTS = 1.3  # cache=tiny: each engine holds this many mean prompts (grown to fit the largest)
# Axes whose default values a cell's name leaves out (names from before these axes stay the same).
QUIET = {"engine": "full", "prefill": "serial", "tiers": "gpu", "fleet": "agg"}
# tiers=cpu: each engine's GPU cache and the CPU tier behind it (vLLM's CPU offloading) hold these
# shares of the cell's distinct blocks (the cache axis does not apply), and a CPU load takes this
# share of computing the same tokens (4 ms against ~30 ms per 1k tokens for an 8B model on an H200)
# tiers=disk: the GPU caches as for tiers=cpu, no CPU tier, and a disk tier behind each (LMCache's
# local-disk backend), the disks holding all of the distinct blocks (a share as above); a disk load
# takes this share of computing the same tokens (a 32B-class model: loading 1k tokens from a local
# NVMe drive takes ~18-37 ms, against ~113-124 ms to compute them again on an H200)
TIERED_CACHE = {"gpu": 0.10, "cpu": 0.50, "disk": 1.0}
CPU_LOAD_SHARE = 0.13
DISK_LOAD_SHARE = 0.25

# --axis and --full pick from tenants x load at these values of the other axes.
BASE = {
    "cache": "tight",
    "client": "stream",
    "prompts": "ids",
    "replicas": "1",
    "engine": "full",
    "prefill": "serial",
    "tiers": "gpu",
    "fleet": "agg",
}
# fleet=pd: half the engines prefill, half decode (their agents' --role), as many as an aggregated
# cell's, and replies long enough that decoding matters: this many output tokens each (--max-output
# is raised to it for such a cell)
PD_OUTPUT_TOKENS = 64
# The default grid: these cells, each at every replica count (DEFAULT_REPLICAS). The first five
# are the grid of issue 12 (token ids, engines reporting vLLM's whole metric set); the others have
# engines that export only three gauges, non-streaming clients and, where "tiny", caches that hold
# one or two prompts: prose conversations as text and as token ids with prefills in parallel, and
# balanced and hot tenants with one prefill at a time.
DEFAULT_CELLS = (
    "balanced/light/tight/stream/ids",
    "hot/heavy/tight/stream/ids",
    "zipf/light/tight/stream/ids",
    "zipf/heavy/loose/stream/ids",
    "zipf/heavy/tight/nostream/text",
    "chat/light/tiny/nostream/text/minimal/parallel",
    "chat/light/loose/nostream/text/minimal/parallel",
    "chat/light/tiny/nostream/ids/minimal/parallel",
    "balanced/heavy/tiny/nostream/ids/minimal",
    "hot/heavy/tiny/nostream/ids/minimal",
    # closed-loop clients (as many as engines, each turn sent when the last is answered: about one
    # request in flight per engine): where issue 55 found kv behind the longest prefix on real vLLM
    "balanced/closed/tight/stream/ids",
    "chat/closed/tiny/nostream/text/minimal/parallel",
)
DEFAULT_REPLICAS = ("1", "2", "4")

SLOTS = 16  # conversations open at once
HOT_SHARE = 0.8
ZIPF_TENANTS, ZIPF_S = 32, 1.1
BALANCED_TENANTS = 8
TURNS = (2, 6)  # turns per conversation, uniform
ONE_SHOT_SUFFIX = (4, 10)  # blocks of a hot one-shot's unique suffix, uniform
OUTPUT_TOKENS = 8


@dataclass(frozen=True)
class Cell:
    tenants: str
    load: str
    cache: str
    client: str
    prompts: str
    replicas: str
    engine: str = "full"
    prefill: str = "serial"
    tiers: str = "gpu"
    fleet: str = "agg"

    @property
    def name(self) -> str:
        quiet = "".join(f"/{getattr(self, a)}" for a, default in QUIET.items() if getattr(self, a) != default)
        return f"{self.tenants}/{self.load}/{self.cache}/{self.client}/{self.prompts}/r{self.replicas}{quiet}"

    def axes(self) -> dict[str, str]:
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def engine_setting(self) -> tuple[str, ...]:
        """What the engines of a cell depend on: cells that differ only in client, prompts or
        replicas share one stack."""
        return self.tenants, self.load, self.cache, self.engine, self.prefill, self.tiers, self.fleet


def cell_named(name: str, replicas: str) -> Cell:
    """A :data:`DEFAULT_CELLS` entry at ``replicas``: the quiet axes' values by name, in any order."""
    tenants, load, cache, client, prompts, *rest = name.split("/")
    quiet = dict(QUIET)
    for value in rest:
        axis = next(a for a in QUIET if value in AXES[a])
        quiet[axis] = value
    return Cell(tenants, load, cache, client, prompts, replicas, **quiet)


def parse_axis(flag: str) -> tuple[str, tuple[str, ...]]:
    """``NAME=V1,V2`` -> (name, values); a ValueError naming what is wrong otherwise."""
    name, sep, values = flag.partition("=")
    name = name.strip()
    if name not in AXES:
        raise ValueError(f"unknown axis {name!r} in --axis {flag}: the axes are {', '.join(AXES)}")
    picked = tuple(dict.fromkeys(v.strip() for v in values.split(",") if v.strip()))
    if not sep or not picked:
        raise ValueError(f"--axis {flag} names no value: give --axis {name}={','.join(AXES[name])}")
    for value in picked:
        if value not in AXES[name]:
            raise ValueError(f"unknown {name} {value!r} in --axis {flag}: choose from {', '.join(AXES[name])}")
    return name, picked


def grid(axis_flags: list[str], full: bool) -> tuple[dict[str, tuple[str, ...]], list[Cell]]:
    """The grid's axes and its cells, in the order they run (cells that share an engine setting
    are next to each other). Without ``--axis`` or ``--full``: :data:`DEFAULT_CELLS` at each of
    :data:`DEFAULT_REPLICAS`; with ``--axis``: tenants x load at :data:`BASE`, each flag replacing
    one axis's values; ``--full``: every value of every axis."""
    if not axis_flags and not full:
        cells = [cell_named(name, r) for name in DEFAULT_CELLS for r in DEFAULT_REPLICAS]
    else:
        axes = {name: values if full or name not in BASE else (BASE[name],) for name, values in AXES.items()}
        for flag in axis_flags:
            name, values = parse_axis(flag)
            axes[name] = values
        cells = [Cell(**dict(zip(AXES, values, strict=True))) for values in itertools.product(*axes.values())]
    setting = ("tenants", "load", "cache", "engine", "prefill", "tiers", "fleet")
    cells.sort(key=lambda c: [AXES[a].index(getattr(c, a)) for a in setting])
    used = {name: tuple(dict.fromkeys(getattr(c, name) for c in cells)) for name in AXES}
    return {name: tuple(v for v in AXES[name] if v in used[name]) for name in AXES}, cells


def tenant_shares(tenants: str) -> list[float]:
    """Each tenant's share of the requests (tenant 0 first)."""
    if tenants in ("balanced", "chat"):
        return [1 / BALANCED_TENANTS] * BALANCED_TENANTS
    if tenants == "hot":
        return [HOT_SHARE] + [(1 - HOT_SHARE) / (BALANCED_TENANTS - 1)] * (BALANCED_TENANTS - 1)
    if tenants == "zipf":
        weights = [1 / (k**ZIPF_S) for k in range(1, ZIPF_TENANTS + 1)]
        return [w / sum(weights) for w in weights]
    raise ValueError(f"unknown tenants {tenants!r}")


@dataclass(frozen=True)
class Workload:
    """A cell's requests in arrival order (``at_s`` in simulated seconds)."""

    requests: list[TraceRequest]
    after: list[int | None]  # the previous turn of the request's conversation (None: a first turn)
    tenants: list[int]  # the tenant of each request
    rate: float  # arrivals per simulated second
    texts: list[str] | None = None  # the prompts as text, when the workload is written as text (chat)
    block_tokens: int = TRACE_BLOCK  # tokens per entry of a request's hash_ids

    @property
    def mean_prompt_tokens(self) -> float:
        return mean_prompt_tokens(self.requests)


def mean_prompt_tokens(requests: list[TraceRequest]) -> float:
    return sum(r.input_length for r in requests) / max(len(requests), 1)


def prefill_capacity(engines: int, prefill_ms_per_1k: float) -> float:
    """The fleet's prefill rate, prompt tokens per simulated second, with no cache hit."""
    return engines * 1_000_000 / prefill_ms_per_1k  # 1000 tokens per prefill_ms_per_1k / 1000 seconds


def arrival_rate(load: float, engines: int, prefill_ms_per_1k: float, mean_prompt: float) -> float:
    """Requests per simulated second: ``load x capacity / mean prompt tokens``."""
    return load * prefill_capacity(engines, prefill_ms_per_1k) / mean_prompt


@dataclass
class _Conversation:
    tenant: int
    ids: list[int]
    turns_left: int
    one_shot: bool
    last: int | None = None  # its latest request's index


def conversations(tenants: str, count: int, seed: int) -> tuple[list[TraceRequest], list[int | None], list[int]]:
    """``count`` requests (no times yet), each one's previous turn and its tenant."""
    rng = random.Random(f"regimes/{tenants}/{seed}")
    shares = tenant_shares(tenants)
    fresh = itertools.count(1_000_000)
    hot = tenants == "hot"
    systems = [[next(fresh) for _ in range(4 if hot and t == 0 else rng.randint(2, 4))] for t in range(len(shares))]
    one_shot_fraction = [0.5 if hot and t == 0 else 0.0 for t in range(len(shares))]
    mean_turns = (TURNS[0] + TURNS[1]) / 2
    # A conversation of tenant t brings E[turns of t] requests: draw tenants in proportion to
    # share / E[turns], so that the requests' shares are the axis's.
    expected = [f * 1 + (1 - f) * mean_turns for f in one_shot_fraction]
    weights = [s / e for s, e in zip(shares, expected, strict=True)]

    def start() -> _Conversation:
        tenant = rng.choices(range(len(shares)), weights)[0]
        if rng.random() < one_shot_fraction[tenant]:
            suffix = [next(fresh) for _ in range(rng.randint(*ONE_SHOT_SUFFIX))]
            return _Conversation(tenant, systems[tenant] + suffix, 1, True)
        return _Conversation(tenant, list(systems[tenant]), rng.randint(*TURNS), False)

    slots: list[_Conversation | None] = [None] * SLOTS
    requests, after, owners = [], [], []
    for index in range(count):
        slot = rng.randrange(SLOTS)
        chat = slots[slot]
        if chat is None or chat.turns_left == 0:
            chat = slots[slot] = start()
        if not chat.one_shot:
            chat.ids += [next(fresh) for _ in range(1 if chat.last is None else rng.choice((1, 1, 2)))]
        requests.append(TraceRequest(0.0, len(chat.ids) * TRACE_BLOCK, OUTPUT_TOKENS, tuple(chat.ids)))
        after.append(chat.last)
        owners.append(chat.tenant)
        chat.last, chat.turns_left = index, chat.turns_left - 1
    return requests, after, owners


def pd_roles(engines: int) -> list[str]:
    """A fleet=pd cell's engines: the first half prefill, the rest decode."""
    return ["prefill"] * (engines // 2) + ["decode"] * (engines - engines // 2)


def workload(
    tenants: str, load: str, count: int, seed: int, engines: int, prefill_ms_per_1k: float, block_size: int = 16
) -> Workload:
    """A cell's requests with Poisson arrival times at the load's rate (simulated seconds)."""
    texts, block_tokens = None, TRACE_BLOCK
    if tenants == "chat":
        chats = chat_conversations(count, seed, ModelPrompts(TINY_MODEL_DIR), block_size)
        requests, after, owners, texts, block_tokens = (
            chats.requests,
            chats.after,
            chats.tenants,
            chats.texts,
            block_size,
        )
    else:
        requests, after, owners = conversations(tenants, count, seed)
    rate = arrival_rate(LOAD[load], engines, prefill_ms_per_1k, mean_prompt_tokens(requests))
    gaps = random.Random(f"regimes/arrivals/{seed}")
    at = 0.0
    timed = []
    for request in requests:
        at += gaps.expovariate(1.0)  # unit-rate gaps, scaled: the load only stretches time
        timed.append(replace(request, at_s=at / rate))
    return Workload(timed, after, owners, rate, texts, block_tokens)
