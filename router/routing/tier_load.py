"""What the router learns of a lower cache tier's load time, from the TTFTs it observes (pure).

A request that loads ``L`` tokens of its prefix from a worker's CPU (or disk, remote) tier waits
for that load beside the prefill the TTFT model predicts for it, so the part of its TTFT the model
does not explain (its *residual*) is ``load_s_per_token * L`` plus noise. Each tier keeps
exponentially weighted sums of ``residual * L`` and ``L * L`` over the requests that loaded from
that tier alone, and its load time per token is their ratio, shrunk towards the flag's value
(``--tier-load-ms``) as if ``PRIOR_OBSERVATIONS`` requests of ``PRIOR_TOKENS`` had measured
exactly that: a few requests move it little, a few hundred set it. Never negative.

The sums are shared by every router replica like the rest of the model (router.routing.model_sync,
groups ``("t", tier)``), so replicas agree on what a tier is worth.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_OBSERVATIONS = 8.0  # the flag's value weighs like this many requests ...
PRIOR_TOKENS = 1024.0  # ... each loading this many tokens


@dataclass
class TierLoadSums:
    """Decayed sums for one tier: residual x loaded tokens, loaded tokens squared, and count."""

    decay: float
    ry: float = 0.0
    ll: float = 0.0
    n: float = 0.0
    since_sync: int = 0

    def add(self, loaded_tokens: float, residual_s: float) -> None:
        self.since_sync += 1
        self.ry = self.ry * self.decay + residual_s * loaded_tokens
        self.ll = self.ll * self.decay + loaded_tokens * loaded_tokens
        self.n = self.n * self.decay + 1.0

    def vector(self) -> tuple[float, ...]:
        return (self.ry, self.ll, self.n)

    def set_vector(self, values: tuple[float, ...]) -> None:
        self.ry, self.ll, self.n = values


def learned_load_s_per_token(sums: tuple[float, ...] | None, prior_s_per_token: float) -> float:
    """A tier's load time per token from its sums (``TierLoadSums.vector``), shrunk towards the
    prior; the prior itself while nothing was observed."""
    if sums is None:
        return prior_s_per_token
    ry, ll = sums[0], sums[1]
    weight = PRIOR_OBSERVATIONS * PRIOR_TOKENS * PRIOR_TOKENS
    return max((ry + weight * prior_s_per_token) / (ll + weight), 0.0)
