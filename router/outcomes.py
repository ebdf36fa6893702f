"""What a relayed reply taught: the usage against the prediction, the decision's accounting (the
metrics, the dashboard's window and prefixes) and the access log's fields."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvindex.roles import BOTH
from kvindex.tiers import LOWER_TIERS
from router.routing.accounting import Split, lost_split, shared_prefix
from router.routing.decision import Decision, predicted_cached_tokens, scored_on
from router.routing.scoring import Candidate
from router.state import RouterState

log = logging.getLogger("router.app")  # the name it always had: log filters rely on it


def reported_cached(usage: dict | None) -> int | None:
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def split_fields(decision: Decision, candidate: Candidate | None = None, reported: int | None = None) -> dict:
    """The accounting's fields of the access log and /debug/route (None: unknown, for a degraded decision)."""
    return log_fields(lost_split(decision, candidate, reported))


def log_fields(found: Split | None) -> dict:
    if found is None:
        return dict.fromkeys(("best_match_tokens", "lost_load_tokens", "lost_stale_tokens", "cold_tokens"))
    return found.log_fields()


def account(state: RouterState, decision: Decision, candidate: Candidate, found: Split | None) -> None:
    """A proxied request's decision quality on the worker that served it (``found``: its split,
    once computed for the log too): the metrics, the dashboard's window and prefixes."""
    if found is None:  # degraded: no match was read; counted by degraded_decisions_total
        return
    now = time.monotonic()
    role = state.fleet.roles(decision.model).get(candidate.worker_id, BOTH)
    state.window.note_split(now, found, role)
    for reason, tokens in found.lost().items():
        if tokens:
            state.metrics.lost_prefix_tokens.labels(reason).inc(tokens)
    state.metrics.cacheable_tokens.labels(decision.model).inc(found.cacheable)
    state.metrics.best_match_tokens.labels(decision.model).inc(found.best_match)
    if found.regret:
        state.metrics.regretted_requests.labels(decision.model).inc()
        state.metrics.regret_tokens.labels(decision.model).inc(found.regret)
    if (prefix := shared_prefix(decision)) is not None:
        state.prefixes.note(decision.model, *prefix, now=now)
    loaded = scored_on(decision, candidate).loaded  # from the CPU, disk, remote tiers
    for tier, blocks in zip(LOWER_TIERS, loaded, strict=False):
        if blocks:
            state.metrics.loaded_tokens.labels(decision.model, tier).inc(blocks * decision.block_size)


def record_usage(state: RouterState, decision: Decision, candidate: Candidate, usage: dict | None) -> None:
    if not usage:
        return
    details = usage.get("prompt_tokens_details") or {}
    model = decision.model
    state.metrics.prompt_tokens.labels(model).inc(int(usage.get("prompt_tokens") or 0))
    cached = details.get("cached_tokens")
    if cached is None:
        return
    predicted = predicted_cached_tokens(decision, candidate)
    state.decider.learner_for(model).note_usage(int(usage.get("prompt_tokens") or 0), int(cached))
    state.metrics.cached_tokens.labels(model).inc(int(cached))
    state.metrics.predicted_cached_tokens.labels(model).inc(predicted)
    outcome = "exact" if predicted == cached else ("over" if predicted > cached else "under")
    state.metrics.predictions.labels(model, outcome).inc()
    state.metrics.prediction_error_tokens.observe(abs(predicted - int(cached)))


def on_failure(state: RouterState, decision: Decision, request_id: str) -> Callable[[Candidate, object], None]:
    """What a failed try on a worker does: counted, logged; an unreachable worker is dropped."""

    def failed(candidate: Candidate, why: object) -> None:
        state.metrics.upstream_errors.labels(candidate.worker_id).inc()
        log.warning("request %s: worker %s failed: %r", request_id, candidate.worker_id, why)
        if isinstance(why, BaseException):
            # Unreachable: not offered until a refresh lists it again. A 5xx (or a redirect) is
            # this request's failure, not the worker's: it stays a candidate.
            state.fleet.drop(decision.model, candidate.worker_id)

    return failed
