"""What the router learns of a lower cache tier's load time, from the TTFTs it observes (pure).

A request that loads ``L`` tokens of its prefix from a worker's CPU (or disk, remote) tier waits
for that load beside the prefill the TTFT model predicts for it: its TTFT is the model's
``base + per_token * x + per_context * w`` plus ``load_s_per_token * L``. Each tier keeps, over
every streamed observation (``L`` is 0 where nothing was loaded from it), exponentially weighted
sums of ``L``, ``L*L`` and ``L`` times the TTFT ``y``, the prefill tokens ``x`` and the attention
work ``w``, decayed in step with the TTFT fit's sums. With the fit's current ``per_token`` and
``per_context`` they give the covariance of ``L`` with the TTFT that the prefill does not explain,
and its ratio to the variance of ``L`` is the load time per token (the load's mean is taken out of
the fit's ``base``, which would otherwise hold it). Shrunk towards the flag's value
(``--tier-load-ms``) as if ``PRIOR_OBSERVATIONS`` requests of ``PRIOR_TOKENS`` had measured exactly
that: a few requests move it little, a few hundred set it. Never negative.

The sums are shared by every router replica like the rest of the model (router.routing.model_sync,
groups ``("t", tier)``), so replicas agree on what a tier is worth.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.routing.ttft_fit import Sums, TtftParams

# TierLoadSums.vector's order (the shared model's fields t:<field>:<tier>)
FIELDS = ("l", "ll", "ly", "lx", "lw", "n")
PRIOR_OBSERVATIONS = 8.0  # the flag's value weighs like this many requests ...
PRIOR_TOKENS = 1024.0  # ... each loading this many tokens


@dataclass
class TierLoadSums:
    """Decayed sums for one tier over every streamed observation: of the tokens loaded from it
    ``l``, their square, and their products with the TTFT ``y``, the prefill tokens ``x`` and
    the attention work ``w``; and the count of the requests that loaded."""

    decay: float
    l: float = 0.0  # noqa: E741 (the sums are named by their terms, as ttft_fit.Sums)
    ll: float = 0.0
    ly: float = 0.0
    lx: float = 0.0
    lw: float = 0.0
    n: float = 0.0
    since_sync: int = 0

    def add(self, loaded_tokens: float, seconds: float, prefill_tokens: float, attention: float) -> None:
        """One observation (``loaded_tokens`` 0: it loaded nothing from this tier)."""
        self.since_sync += 1
        d, load = self.decay, loaded_tokens
        self.l = self.l * d + load
        self.ll = self.ll * d + load * load
        self.ly = self.ly * d + load * seconds
        self.lx = self.lx * d + load * prefill_tokens
        self.lw = self.lw * d + load * attention
        self.n = self.n * d + (1.0 if load else 0.0)

    def vector(self) -> tuple[float, ...]:
        return (self.l, self.ll, self.ly, self.lx, self.lw, self.n)

    def set_vector(self, values: tuple[float, ...]) -> None:
        self.l, self.ll, self.ly, self.lx, self.lw, self.n = values

    def residual_sums(self, fleet: Sums, params: TtftParams) -> tuple[float, float] | None:
        """(covariance of the loaded tokens with the TTFT the prefill leaves unexplained, variance
        of the loaded tokens), both times the observations' weight, over ``fleet``'s observations
        and the fit ``params`` from them; None while nothing was loaded."""
        count = fleet.n
        if count <= 0 or self.ll <= 0:
            return None
        mean_l, mean_x, mean_y, mean_w = self.l / count, fleet.x / count, fleet.y / count, fleet.w / count
        variance = self.ll / count - mean_l * mean_l
        cov_y = self.ly / count - mean_l * mean_y
        cov_x = self.lx / count - mean_l * mean_x
        cov_w = self.lw / count - mean_l * mean_w
        unexplained = cov_y - params.per_token_s * cov_x - params.per_context_s * cov_w
        return unexplained * count, variance * count

    def mean(self, fleet: Sums) -> float:
        """The tokens loaded from this tier per observation, on average."""
        return self.l / fleet.n if fleet.n > 0 else 0.0


def learned_load_s_per_token(sums: tuple[float, float] | None, prior_s_per_token: float) -> float:
    """A tier's load time per token from its residual sums (``TierLoadSums.residual_sums``),
    shrunk towards the prior; the prior itself while nothing was observed."""
    if sums is None:
        return prior_s_per_token
    ry, ll = sums
    weight = PRIOR_OBSERVATIONS * PRIOR_TOKENS * PRIOR_TOKENS
    return max((ry + weight * prior_s_per_token) / (ll + weight), 0.0)
