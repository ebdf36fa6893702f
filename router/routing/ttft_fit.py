"""The least-squares fit behind the TTFT model (pure): exponentially weighted sums of
observations and the coefficients they give.

A request's time to its first byte is fitted as

    base + per_token * x + per_context * w (+ per_output * z for a whole reply)

over its observations, where ``x`` is the prefill tokens it waited for (the uncached tokens
booked ahead of it and its own), ``w`` the attention work of that prefill (for each prefill of N
new tokens after P already computed, ``N * (P + N / 2) / 1000``: attention reads the whole
context for every new token, so a chunk of 992 tokens after 31,776 cached ones took 4x what the
same tokens took cold on an H200, issue 37) and ``z`` a whole reply's completion tokens (its
decode; 0 for a first byte). A term the data cannot tell apart (its size barely varies, or it
moves with the prefill's size) keeps its prior; a term the fit makes negative is left out (its
effect is below the noise), so no coefficient is ever negative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PRIOR_PER_TOKEN_S = 1e-4  # 10k prefill tokens/s: only the ratio to other terms matters until learned
MIN_SPREAD_TOKENS = 64.0  # below this spread of prefill sizes the slope is not identifiable
MIN_SPREAD_OUTPUT = 1.0  # below this spread of reply lengths the decode rate is not identifiable
MIN_SPREAD_CONTEXT = 64.0  # below this spread of attention work (k-token^2) its slope is not identifiable
MAX_CORRELATION = 0.98  # a term this collinear with the prefill's size cannot be told apart from it
# "yy" last: replicas from before it share the other sums (a group read without it is not complete)
SUM_FIELDS = ("n", "x", "y", "z", "xx", "xy", "zz", "xz", "zy", "w", "ww", "xw", "zw", "wy", "yy")
TERMS = ("x", "z", "w")


def attention_work(new_tokens: float, context_tokens: float) -> float:
    """A prefill's attention work, in thousands of token pairs: ``N * (P + N / 2) / 1000``."""
    return new_tokens * (context_tokens + new_tokens / 2) / 1000


@dataclass(frozen=True)
class TtftParams:
    base_s: float = 0.0
    per_token_s: float = PRIOR_PER_TOKEN_S
    per_context_s: float = 0.0  # per unit of attention work (attention_work); 0: linear in tokens

    def seconds(self, prefill_tokens: float, attention: float = 0.0) -> float:
        return self.base_s + self.per_token_s * prefill_tokens + self.per_context_s * attention


@dataclass(frozen=True)
class Fit:
    """A least-squares fit: TTFT parameters, and the decode time per reply token (whole replies)."""

    params: TtftParams
    decode_per_token_s: float | None = None
    rate_known: bool = False  # the per-token rate was fitted from the data (not the prior's, nor dropped)


@dataclass
class Sums:
    """Exponentially weighted sums for a least-squares fit of ``y`` (seconds) on ``x`` (prefill
    tokens), ``w`` (their attention work) and, for whole replies, ``z`` (completion tokens)."""

    n: float = 0.0
    x: float = 0.0
    y: float = 0.0
    z: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    zz: float = 0.0
    xz: float = 0.0
    zy: float = 0.0
    w: float = 0.0
    ww: float = 0.0
    xw: float = 0.0
    zw: float = 0.0
    wy: float = 0.0
    yy: float = 0.0
    since_sync: int = 0  # observations added since the model was last shared (router.routing.model_sync)

    def add(self, x: float, y: float, decay: float, z: float = 0.0, w: float = 0.0) -> None:
        self.since_sync += 1
        for name, value in (
            ("n", 1.0),
            ("x", x),
            ("y", y),
            ("z", z),
            ("xx", x * x),
            ("xy", x * y),
            ("zz", z * z),
            ("xz", x * z),
            ("zy", z * y),
            ("w", w),
            ("ww", w * w),
            ("xw", x * w),
            ("zw", z * w),
            ("wy", w * y),
            ("yy", y * y),
        ):
            setattr(self, name, getattr(self, name) * decay + value)

    def vector(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in SUM_FIELDS)

    def set_vector(self, values: tuple[float, ...]) -> None:
        for name, value in zip(SUM_FIELDS, values, strict=True):
            setattr(self, name, value)

    def fit(self, prior: TtftParams) -> Fit:
        return fit(self, prior)

    def rate_error(self) -> float:
        """The standard error of the per-token rate these observations give (seconds per token),
        from the simple regression of ``y`` on ``x``: what is left of y's variance once x's part
        is taken out, over x's spread and the observations. Infinite while the rate cannot be
        told (fewer than three observations, or sizes that do not vary). The terms beside x
        (decode, attention) count as noise here: an error too large, never too small. The weights
        decay, so the effective observations are at least ``n``: ``n`` errs on the large side too."""
        n = self.n
        var_x = self.xx / n - (self.x / n) ** 2 if n > 0 else 0.0
        if n < 3 or var_x <= MIN_SPREAD_TOKENS**2:
            return math.inf
        cov_xy = self.xy / n - self.x * self.y / n**2
        residual = max(self.yy / n - (self.y / n) ** 2 - cov_xy**2 / var_x, 0.0) * n / (n - 2)
        return math.sqrt(residual / (var_x * n))


def _product(sums: Sums, a: str, b: str) -> float:
    """The weighted sum of a * b (``y`` included) by its field name, in either order."""
    return float(getattr(sums, a + b if hasattr(sums, a + b) else b + a))


def solve(matrix: list[list[float]], right: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a singular system."""
    size = len(right)
    rows = [[*matrix[i], right[i]] for i in range(size)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-300:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(size):
            if r != col:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col], strict=True)]
    return [rows[i][size] / rows[i][i] for i in range(size)]


def fit(sums: Sums, prior: TtftParams) -> Fit:
    """The coefficients of :class:`Sums` (the module's docstring says which terms it keeps)."""
    if sums.n < 1:
        return Fit(prior)
    n = sums.n
    mean = {k: getattr(sums, k) / n for k in ("x", "y", "z", "w")}

    def cov(a: str, b: str) -> float:
        return _product(sums, a, b) / n - mean[a] * mean[b]

    spread = {"x": MIN_SPREAD_TOKENS, "z": MIN_SPREAD_OUTPUT, "w": MIN_SPREAD_CONTEXT}
    varies = {k: cov(k, k) > spread[k] ** 2 for k in TERMS}
    for k in ("z", "w"):  # moving with the prefill's size: not told apart from it
        if varies[k] and varies["x"] and cov("x", k) ** 2 >= MAX_CORRELATION**2 * cov("x", "x") * cov(k, k):
            varies[k] = False
    fallback = {"x": prior.per_token_s, "z": 0.0, "w": prior.per_context_s}
    free = [k for k in TERMS if varies[k]]
    fixed = {k: fallback[k] for k in TERMS if not varies[k]}
    coef: dict[str, float] = {}
    decode_known = varies["z"]
    while free:
        right = [cov(k, "y") - sum(fixed[f] * cov(k, f) for f in fixed) for k in free]
        solved = solve([[cov(a, b) for b in free] for a in free], right)
        if solved is None:
            fixed.update({k: fallback[k] for k in free})
            break
        coef = dict(zip(free, solved, strict=True))
        negative = [k for k in free if coef[k] < 0]
        if not negative or free == ["z"]:  # the decode alone: at least 0, and known
            break
        for k in negative:
            free.remove(k)
            # The prefill's effect lost in the noise (small prompts on a fast engine): the other
            # terms with the prior's slope; alone and negative, no slope at all. A decode that
            # the prefill's size explains away is not known.
            fixed[k] = fallback["x"] if k == "x" and free else 0.0
            decode_known = decode_known and k != "z"
        coef = {}
    values = {**fixed, **coef}
    base = max(mean["y"] - sum(values[k] * mean[k] for k in TERMS), 0.0)
    params = TtftParams(base, max(values["x"], 0.0), max(values["w"], 0.0))
    return Fit(params, max(values["z"], 0.0) if decode_known else None, "x" in coef)
