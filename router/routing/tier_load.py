"""What the router learns of a lower cache tier's load cost, from the TTFTs it observes (pure).

A request that loads ``L`` tokens of its prefix from a worker's CPU (or disk, remote) tier waits
for that load beside the prefill the TTFT model predicts for it. An engine loads asynchronously
(vLLM's connectors: the request waits while others compute) and schedules the request's prefill
in a step after the load ends, so the load costs a wait per load (about one engine step) plus a
time per token: its TTFT is the model's ``base + per_token * x + per_context * w`` plus
``wait * I + per_token_load * L`` (``I`` 1 for a request that loaded from the tier).

Each tier keeps, over every streamed observation (``I`` and ``L`` 0 where nothing was loaded from
it), exponentially weighted sums of ``I``, ``L``, ``L*L`` and of ``I`` and ``L`` times the TTFT
``y``, the prefill tokens ``x`` and the attention work ``w``, decayed in step with the TTFT fit's
sums. With the fit's current ``per_token`` and ``per_context`` they give the covariances of ``I``
and ``L`` with the TTFT the prefill leaves unexplained, and the least-squares ``wait`` and
``per_token_load`` follow (the loads' mean is taken out of the fit's ``base``, which held it).
Shrunk towards no wait and the flag's time per token (``--tier-load-ms``) as if
``PRIOR_OBSERVATIONS`` loads of ``PRIOR_TOKENS`` had measured exactly that: a few loads move them
little, a few hundred set them. Never negative.

The sums are shared by every router replica like the rest of the model (router.routing.model_sync,
groups ``("t", tier)``), so replicas agree on what a tier costs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from router.routing.ttft_fit import Sums, TtftParams

# TierLoadSums.vector's order (the shared model's fields t:<field>:<tier>)
FIELDS = ("n", "l", "ll", "iy", "ix", "iw", "ly", "lx", "lw")
PRIOR_OBSERVATIONS = 8.0  # the prior weighs like this many loads ...
PRIOR_TOKENS = 1024.0  # ... each of this many tokens


@dataclass(frozen=True)
class TierLoad:
    """A tier's learned load cost: a wait per load and a time per loaded token."""

    wait_s: float = 0.0
    per_token_s: float = 0.0

    def seconds(self, tokens: float) -> float:
        return self.wait_s + self.per_token_s * tokens if tokens > 0 else 0.0


@dataclass(frozen=True)
class LoadMoments:
    """Weighted (co)variances over the observations: of the load indicator ``I`` and the loaded
    tokens ``L``, and of each with the TTFT the prefill fit leaves unexplained (``r``)."""

    ii: float
    il: float
    ll: float
    ir: float
    lr: float
    mean_i: float  # loads per observation
    mean_l: float  # loaded tokens per observation


@dataclass
class TierLoadSums:
    """Decayed sums for one tier over every streamed observation (module docstring)."""

    decay: float
    n: float = 0.0  # loads (sum of I, = sum of I*I)
    l: float = 0.0  # noqa: E741 (the sums are named by their terms, as ttft_fit.Sums)
    ll: float = 0.0
    iy: float = 0.0
    ix: float = 0.0
    iw: float = 0.0
    ly: float = 0.0
    lx: float = 0.0
    lw: float = 0.0
    since_sync: int = 0

    def add(self, loaded_tokens: float, seconds: float, prefill_tokens: float, attention: float) -> None:
        """One observation (``loaded_tokens`` 0: it loaded nothing from this tier)."""
        self.since_sync += 1
        values = dict.fromkeys(FIELDS, 0.0)
        if loaded_tokens > 0:
            i, load = 1.0, loaded_tokens
            values.update(n=i, l=load, ll=load * load, iy=seconds, ix=prefill_tokens, iw=attention)
            values.update(ly=load * seconds, lx=load * prefill_tokens, lw=load * attention)
        for name in FIELDS:
            setattr(self, name, getattr(self, name) * self.decay + values[name])

    def vector(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in FIELDS)

    def set_vector(self, values: tuple[float, ...]) -> None:
        for name, value in zip(FIELDS, values, strict=True):
            setattr(self, name, value)

    def moments(self, fleet: Sums, params: TtftParams) -> LoadMoments | None:
        """The moments over ``fleet``'s observations with its fit ``params``; None while no load."""
        count = fleet.n
        if count <= 0 or self.n <= 0:
            return None
        mean_i, mean_l = self.n / count, self.l / count
        mean_r = (fleet.y - params.per_token_s * fleet.x - params.per_context_s * fleet.w) / count

        def unexplained(ty: float, tx: float, tw: float) -> float:  # E[T * r], T = I or L
            return (ty - params.per_token_s * tx - params.per_context_s * tw) / count

        return LoadMoments(
            ii=mean_i - mean_i * mean_i,
            il=mean_l - mean_i * mean_l,
            ll=self.ll / count - mean_l * mean_l,
            ir=unexplained(self.iy, self.ix, self.iw) - mean_i * mean_r,
            lr=unexplained(self.ly, self.lx, self.lw) - mean_l * mean_r,
            mean_i=mean_i,
            mean_l=mean_l,
        )


def learned_load(moments: LoadMoments | None, count: float, prior_per_token_s: float) -> TierLoad:
    """A tier's load cost from its moments over ``count`` observations, shrunk towards no wait
    and ``prior_per_token_s``; the prior itself while nothing was loaded."""
    if moments is None or count <= 0:
        return TierLoad(0.0, prior_per_token_s)
    m = moments
    # normal equations in sums (moments times the count), with the prior's pseudo-loads added
    # (the wait's prior: PRIOR_OBSERVATIONS loads, each as far from the indicator's mean as a load is)
    prior_i = PRIOR_OBSERVATIONS * (1 - m.mean_i) ** 2
    prior_l = PRIOR_OBSERVATIONS * PRIOR_TOKENS * PRIOR_TOKENS
    s_ii, s_il, s_ll = m.ii * count + prior_i, m.il * count, m.ll * count + prior_l
    b_i, b_l = m.ir * count, m.lr * count + prior_l * prior_per_token_s
    det = s_ii * s_ll - s_il * s_il
    wait = (b_i * s_ll - b_l * s_il) / det if det > 0 else 0.0
    per_token = (s_ii * b_l - s_il * b_i) / det if det > 0 else prior_per_token_s
    if per_token < 0:  # no time per token: all in the wait
        per_token, wait = 0.0, b_i / s_ii
    if wait < 0:  # no wait: all in the time per token
        wait, per_token = 0.0, max(b_l / s_ll, 0.0)
    return TierLoad(max(wait, 0.0), per_token)


@dataclass
class TierLoads:
    """Every lower tier's sums, and what learning starts from (``priors``: load time per token)."""

    decay: float
    priors: Mapping[str, float]
    sums: dict[str, TierLoadSums] = field(default_factory=dict)

    def observe(
        self, prefill_tokens: float, seconds: float, attention: float, loaded: tuple[str, float] | None
    ) -> None:
        """Every tier's sums take a streamed observation (in step with the fit's), with its loaded
        tokens where it loaded them and 0 elsewhere."""
        if loaded is not None and loaded[1] > 0 and loaded[0] not in self.sums:
            self.sums[loaded[0]] = TierLoadSums(self.decay)
        for tier, sums in self.sums.items():
            tokens = loaded[1] if loaded is not None and loaded[0] == tier else 0.0
            sums.add(max(tokens, 0.0), seconds, prefill_tokens, attention)

    def learned(self, fleet: Sums, params: TtftParams) -> dict[str, TierLoad]:
        """Each tier's load cost against ``params``, the fit of ``fleet`` (just made)."""
        out = {}
        for tier, sums in self.sums.items():
            moments = sums.moments(fleet, params)
            if moments is not None:
                out[tier] = learned_load(moments, fleet.n, self.priors.get(tier, 0.0))
        return out

    def without_loads(self, fleet: Sums, params: TtftParams) -> TtftParams:
        """``params`` with the tiers' mean load cost taken out of its base (which held it)."""
        if fleet.n <= 0:
            return params
        load_s = sum(
            (load.wait_s * self.sums[tier].n + load.per_token_s * self.sums[tier].l) / fleet.n
            for tier, load in self.learned(fleet, params).items()
        )
        return replace(params, base_s=max(params.base_s - load_s, 0.0)) if load_s else params
