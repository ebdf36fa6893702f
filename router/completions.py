"""The completion endpoints' flow: the body decoded,
the prompt tokenized, the decision, the request forwarded and its reply relayed, then what the
reply taught (usage, the TTFT model, the accounting, the access log's fields)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from kvindex.tiers import LOWER_TIERS
from router.http.edges import ApiError
from router.http.wire import HttpRequest
from router.prompts.body import TOO_DEEP, BodyError, decode_body
from router.prompts.tokenization import BadPrompt, PromptTooLong, TokenizeFailed
from router.routing.accounting import Split
from router.routing.booking import Booking
from router.routing.decide import Decision, NoWorkers
from router.routing.fleet import Fleet
from router.routing.scoring import Candidate
from router.state import RouterState
from router.upstream.proxy import Downstream, Outgoing, UpstreamFailed, forward

log = logging.getLogger("router.app")


async def decoded(state: RouterState, raw: bytes) -> dict[str, Any]:
    """The request's JSON body, checked as far as every endpoint needs."""
    try:
        body = await decode_body(raw, state.settings.max_prompt_tokens, state.id_memo)
    except BodyError as exc:
        raise ApiError(exc.status, str(exc)) from None
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' must be a non-empty string")
    return body


async def decide(state: RouterState, body: dict[str, Any], chat: bool, dry_run: bool = False) -> Decision:
    """The decision for a request; ``dry_run`` (/debug/route) changes no routing state and no metric."""
    served = state.fleet.served(body["model"])
    if served is None:
        raise _no_worker_error(state, body["model"])
    model, adapter = served.model, served.adapter  # an adapter's prompt is the base model's text
    workers = state.fleet.alive(model, adapter)
    tokens: Sequence[int]
    try:
        if chat:
            tokens = await state.tokenization.chat(model, body, workers[0].url)
        else:
            tokens = await state.tokenization.completion(model, body, workers[0].url)
    except PromptTooLong as exc:
        raise ApiError(413, str(exc)) from None
    except BadPrompt as exc:
        raise ApiError(400, str(exc)) from None
    except RecursionError:
        raise ApiError(400, TOO_DEEP) from None
    except (OSError, TokenizeFailed) as exc:  # ConnectionError, TimeoutError, a refused or failed /tokenize
        # The detail names the worker's address: the log's, not the client's.
        log.warning("tokenizing through worker %s failed: %s", workers[0].worker_id, exc)
        raise ApiError(502, "could not tokenize the prompt through a worker", "upstream_error") from None
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(400, "'cache_salt' must be a non-empty string")
    try:
        decision = await state.decider.decide(model, tokens, salt, dry_run, adapter)
    except NoWorkers as exc:
        raise ApiError(503, str(exc), "service_unavailable") from None
    if dry_run:
        return decision
    state.window.note_decision(time.monotonic(), decision.degraded)
    state.metrics.decision_seconds.observe(decision.seconds)
    state.metrics.degraded_mode.set(1 if state.decider.degraded else 0)
    if decision.degraded:
        state.metrics.degraded.inc()
        state.metrics.degraded_causes.labels(decision.degraded_cause or "error").inc()
    return decision


def _no_worker_error(state: RouterState, model: str) -> ApiError:
    """404 only when the index says the model does not exist; 503 when the router cannot know."""
    fleet = state.fleet
    if not fleet.has_view:
        # Where Redis is and why it failed are in the log (at start-up); not told to clients.
        message = "the router has no view of the workers yet: the index's Redis is unreachable"
        return ApiError(503, message, "service_unavailable")
    if fleet.known(model):
        return ApiError(503, f"no alive worker serves model {model!r}", "service_unavailable")
    served = ", ".join(_with_adapters(fleet, m) for m in fleet.models_with_workers()) or "none"
    return ApiError(404, f"The model `{model}` does not exist. Models served: {served}.", "not_found_error")


def _with_adapters(fleet: Fleet, model: str) -> str:
    adapters = fleet.adapters(model)
    return f"{model} (LoRA adapters: {', '.join(adapters)})" if adapters else model


def _reported_cached(usage: dict | None) -> int | None:
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def split_fields(decision: Decision, candidate: Candidate | None = None, reported: int | None = None) -> dict:
    """The accounting's fields of the access log and /debug/route (None: unknown, for a degraded decision)."""
    return _log_fields(decision.split(candidate, reported))


def _log_fields(found: Split | None) -> dict:
    if found is None:
        return dict.fromkeys(("best_match_tokens", "lost_load_tokens", "lost_stale_tokens", "cold_tokens"))
    return found.log_fields()


def _account(state: RouterState, decision: Decision, candidate: Candidate, found: Split | None) -> None:
    """A proxied request's decision quality on the worker that served it (``found``: its split,
    once computed for the log too): the metrics, the dashboard's window and prefixes."""
    if found is None:  # degraded: no match was read; counted by degraded_decisions_total
        return
    now = time.monotonic()
    state.window.note_split(now, found)
    for reason, tokens in found.lost().items():
        if tokens:
            state.metrics.lost_prefix_tokens.labels(reason).inc(tokens)
    state.metrics.cacheable_tokens.labels(decision.model).inc(found.cacheable)
    state.metrics.best_match_tokens.labels(decision.model).inc(found.best_match)
    if found.regret:
        state.metrics.regretted_requests.labels(decision.model).inc()
        state.metrics.regret_tokens.labels(decision.model).inc(found.regret)
    if (prefix := decision.shared_prefix()) is not None:
        state.prefixes.note(decision.model, *prefix, now=now)
    loaded = decision.scored(candidate).loaded  # from the CPU, disk, remote tiers
    for tier, blocks in zip(LOWER_TIERS, loaded, strict=False):
        if blocks:
            state.metrics.loaded_tokens.labels(decision.model, tier).inc(blocks * decision.block_size)


def _record_usage(state: RouterState, decision: Decision, candidate: Candidate, usage: dict | None) -> None:
    if not usage:
        return
    details = usage.get("prompt_tokens_details") or {}
    model = decision.model
    state.metrics.prompt_tokens.labels(model).inc(int(usage.get("prompt_tokens") or 0))
    cached = details.get("cached_tokens")
    if cached is None:
        return
    predicted = decision.predicted_cached_tokens(candidate)
    state.decider.learner_for(model).note_usage(int(usage.get("prompt_tokens") or 0), int(cached))
    state.metrics.cached_tokens.labels(model).inc(int(cached))
    state.metrics.predicted_cached_tokens.labels(model).inc(predicted)
    outcome = "exact" if predicted == cached else ("over" if predicted > cached else "under")
    state.metrics.predictions.labels(model, outcome).inc()
    state.metrics.prediction_error_tokens.observe(abs(predicted - int(cached)))


async def proxy_completion(state: RouterState, incoming: HttpRequest, downstream: Downstream, chat: bool) -> None:
    """Route ``incoming`` and relay its reply to ``downstream``; ApiError for the client's
    mistakes and for what the router cannot do (no worker, every try failed)."""
    body = await decoded(state, incoming.body)
    decision = await decide(state, body, chat)
    policy = state.settings.policy.value if not decision.degraded else "degraded"
    request_id = incoming.request_id

    def headers(candidate: Candidate) -> dict[str, str]:
        if not state.settings.routing_headers:
            return {"x-request-id": request_id}
        return {
            "x-kvroute-worker": candidate.worker_id,
            "x-kvroute-cached-tokens": str(decision.predicted_cached_tokens(candidate)),
            "x-request-id": request_id,
        }

    def failed(candidate: Candidate, why: BaseException | int) -> None:
        state.metrics.upstream_errors.labels(candidate.worker_id).inc()
        log.warning("request %s: worker %s failed: %r", request_id, candidate.worker_id, why)
        if not isinstance(why, int):
            # Unreachable: not offered until a refresh lists it again. A 5xx (or a redirect) is
            # this request's failure, not the worker's: it stays a candidate.
            state.fleet.drop(decision.model, candidate.worker_id)

    outgoing = Outgoing(incoming.path, incoming.headers, request_id, incoming.body)
    state.metrics.inflight.inc()
    try:
        streamed = body.get("stream") is True
        with Booking(decision, state.load, state.decider.learner_for(decision.model), streamed) as booking:
            forwarded = await forward(
                outgoing, downstream, state.upstream, decision.candidates, headers, booking, failed
            )
    except UpstreamFailed as exc:
        raise ApiError(502, str(exc), "upstream_error") from None
    finally:
        state.metrics.inflight.dec()
    if forwarded.retried:
        state.metrics.retries.inc()
    state.metrics.decisions.labels(decision.model, forwarded.candidate.worker_id, policy).inc()
    _record_usage(state, decision, forwarded.candidate, forwarded.usage)
    reported = _reported_cached(forwarded.usage)
    found = decision.split(forwarded.candidate, reported)
    _account(state, decision, forwarded.candidate, found)
    incoming.log_fields = {
        "model": decision.model,
        "worker": forwarded.candidate.worker_id,
        "prompt_tokens": decision.prompt_tokens,
        "degraded": decision.degraded,
        "predicted_cached_tokens": decision.predicted_cached_tokens(forwarded.candidate),
        "cached_tokens": reported,
        **_log_fields(found),
        "decision_ms": round(decision.seconds * 1000, 3),
        "retried": forwarded.retried,
    }
