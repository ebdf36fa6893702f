"""Whether trading cache hits for shorter queues pays on the fleet the router serves, measured (pure).

kv prices a prompt on a worker as its own prefill there, plus the prefill queued ahead of it, plus
the delay it adds to the requests that will queue behind it (:mod:`router.routing.scoring`). A
token queued ahead costing as much as a token of one's own prefill holds for an engine that
computes one prefill after another; it does not where engines batch concurrent prefills into the
same steps, or share their compute with each other (vLLM engines on the cores of one CPU, where an
idle engine is no faster than a busy one): there, moving a prompt off the worker with its longest
prefix to a shorter queue re-computes the prefix and saves nothing (issue 55: 8-29 points of hit
rate lost on real vLLM). So the router measures the price instead of assuming it. Each reply is
an observation of

    y = a + b_own * own + b_ahead * ahead + b_else * elsewhere + b_out * output

``y`` the time to the first byte (streamed) or to the whole reply; ``own`` the prompt tokens the
engine computed (the prompt less the cached tokens it reported); ``ahead`` the prefill the decision
saw queued ahead of it on that worker; ``elsewhere`` all it saw queued on the other workers
(fleet-wide contention: on shared cores every engine's work slows every other's);
``output`` a whole reply's completion tokens (0 for a first byte). Moving a request from a worker
with ``A`` queued to one with ``A'`` changes its time by ``(b_ahead - b_else) (A' - A)`` (what is
queued elsewhere changes by as much the other way), so the
price of a queued token relative to a token of one's own prefill is

    queue weight = (b_ahead - b_else) / b_own

fitted by exponentially weighted least squares (:class:`TradeSums`, shared by every replica like
the rest of the model) with its standard error (the delta method over the fit's covariance). The
cost's load terms are scaled by the measured weight, combined with a prior of 1 (engines that
compute queued prefill in turn, as GPUs with chunked prefill do) by their precisions: a prior
``PRIOR_ERROR`` wide weighs like a measurement that sure, so a few dozen replies with queues in
them move it, a few hundred set it. Within [0, 1]: a move away from the longest prefix is paid for
at no more than a queued token measured to cost. The prior rather than 0 while nothing is measured:
a router that trades no hit for load at its start herds a burst of prompts sharing a short prefix
onto its holder (the queues that would measure the price come too late for that burst).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from router.routing.ttft_fit import solve

TERMS = ("own", "ahead", "elsewhere", "output")
# TradeSums.vector's order (the shared model's fields Q:<field>): n, then each term's sum, y's,
# each product of two terms (i <= j), each term times y, and y times y
FIELDS = (
    "n",
    *TERMS,
    "y",
    *(f"{a}*{b}" for i, a in enumerate(TERMS) for b in TERMS[i:]),
    *(f"{a}*y" for a in TERMS),
    "y*y",
)
MIN_SPREAD = {"own": 32.0, "ahead": 32.0, "elsewhere": 16.0, "output": 1.0}  # below: not identifiable
MIN_OBSERVATIONS = 20.0
PRIOR_WEIGHT = 1.0  # a queued token costs what one's own does, until measured otherwise ...
PRIOR_ERROR = 0.5  # ... as sure as a measurement with this standard error
HALF_LIFE = 500.0  # replies after which an old one weighs half (noisier than the TTFT fit: more of them)


@dataclass(frozen=True)
class QueueWeight:
    """The measured price of a queued token relative to one's own, and what the cost uses."""

    estimate: float | None  # (b_ahead - b_else) / b_own; None while it cannot be told
    error: float | None  # its standard error
    observations: float

    @property
    def used(self) -> float:
        """The estimate and the prior weighed by their precisions, within [0, 1] (the prior
        while nothing is measured)."""
        if self.estimate is None or self.error is None:
            return PRIOR_WEIGHT
        prior, measured = PRIOR_ERROR**-2, max(self.error, 1e-9) ** -2
        combined = (prior * PRIOR_WEIGHT + measured * self.estimate) / (prior + measured)
        return min(max(combined, 0.0), 1.0)


UNKNOWN = QueueWeight(None, None, 0.0)


@dataclass
class TradeSums:
    """Exponentially weighted sums of the observations (module docstring), by :data:`FIELDS`."""

    decay: float = 1 - 1 / HALF_LIFE
    since_sync: int = 0

    def __post_init__(self) -> None:
        self.values = dict.fromkeys(FIELDS, 0.0)

    def add(self, own: float, ahead: float, elsewhere: float, output: float, seconds: float) -> None:
        self.since_sync += 1
        x = {"own": own, "ahead": ahead, "elsewhere": elsewhere, "output": output, "y": seconds}
        for name in FIELDS:
            left, _, right = name.partition("*")
            value = 1.0 if name == "n" else x[left] * (x[right] if right else 1.0)
            self.values[name] = self.values[name] * self.decay + value

    def vector(self) -> tuple[float, ...]:
        return tuple(self.values[name] for name in FIELDS)

    def set_vector(self, values: tuple[float, ...]) -> None:
        self.values = dict(zip(FIELDS, values, strict=True))

    def queue_weight(self) -> QueueWeight:
        return queue_weight(self.values)


def _covariances(values: dict[str, float]) -> tuple[dict[tuple[str, str], float], float]:
    """The weighted covariances of the terms and y (keyed by name pairs), and n."""
    n = values["n"]
    names = (*TERMS, "y")
    mean = {k: values[k] / n for k in names}

    def product(a: str, b: str) -> float:
        i, j = names.index(a), names.index(b)
        return values[f"{a}*{b}" if i <= j else f"{b}*{a}"]

    return {(a, b): product(a, b) / n - mean[a] * mean[b] for a in names for b in names}, n


def queue_weight(values: dict[str, float]) -> QueueWeight:
    """The fit of :data:`FIELDS`' sums (module docstring); unknown where the own prefill's or the
    queue's effect cannot be told apart."""
    n = values["n"]
    if n < MIN_OBSERVATIONS:
        return QueueWeight(None, None, n)
    cov, n = _covariances(values)
    free = [k for k in TERMS if cov[(k, k)] > MIN_SPREAD[k] ** 2]
    if "own" not in free or "ahead" not in free:
        return QueueWeight(None, None, n)
    matrix = [[cov[(a, b)] for b in free] for a in free]
    coef = solve(matrix, [cov[(k, "y")] for k in free])
    inverse = _inverse(matrix)
    if coef is None or inverse is None:
        return QueueWeight(None, None, n)
    beta = dict(zip(free, coef, strict=True))
    if beta["own"] <= 0:
        return QueueWeight(None, None, n)
    residual = cov[("y", "y")] - sum(beta[k] * cov[(k, "y")] for k in free)
    sigma2 = max(residual, 0.0) * n / max(n - len(free) - 1, 1.0)
    weight = (beta["ahead"] - beta.get("elsewhere", 0.0)) / beta["own"]
    # the delta method: the gradient of the weight in the coefficients, through their covariance
    gradient = {"own": -weight / beta["own"], "ahead": 1 / beta["own"], "elsewhere": -1 / beta["own"]}
    index = {k: i for i, k in enumerate(free)}
    variance = sum(
        gradient[a] * gradient[b] * inverse[index[a]][index[b]] * sigma2 / n
        for a in gradient
        for b in gradient
        if a in index and b in index
    )
    return QueueWeight(weight, math.sqrt(max(variance, 0.0)), n)


def _inverse(matrix: list[list[float]]) -> list[list[float]] | None:
    """The inverse of a small symmetric matrix, a column at a time (None: singular)."""
    size = len(matrix)
    columns = []
    for i in range(size):
        column = solve(matrix, [1.0 if j == i else 0.0 for j in range(size)])
        if column is None:
            return None
        columns.append(column)
    return [[columns[j][i] for j in range(size)] for i in range(size)]
