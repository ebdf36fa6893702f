"""The completion endpoints' flow: the body decoded,
the prompt tokenized, the decision, the request forwarded and its reply relayed, then what the
reply taught (usage, the TTFT model, the accounting, the access log's fields: router.outcomes). On
a prefill/decode fleet a request may be split instead (router.split_completions)."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

from kvtokens.sampling import SamplingError, check_context_length, check_sampling
from router.http.edges import ApiError
from router.http.wire import HttpRequest
from router.outcomes import account, log_fields, on_failure, record_usage, reported_cached
from router.prompts.body import TOO_DEEP, BodyError, parse_body
from router.prompts.tokenization import BadPrompt, PromptTooLong, TokenizeFailed
from router.routing.accounting import lost_split
from router.routing.booking import Booking
from router.routing.decision import Decision, NoWorkers, predicted_cached_tokens
from router.routing.fleet import Fleet
from router.routing.pd import Baseline, Plan, SplitMode, plan
from router.routing.scoring import Candidate, Policy
from router.split_completions import proxy_split
from router.state import RouterState
from router.upstream.proxy import Downstream, Outgoing, UpstreamFailed, forward

log = logging.getLogger("router.app")
_rng = random.Random()  # the decode worker among equals


async def decoded(state: RouterState, raw: bytes) -> dict[str, Any]:
    """The request's JSON body, checked as far as every endpoint needs."""
    try:
        body = await parse_body(raw, state.settings.max_prompt_tokens, state.id_memo)
    except BodyError as exc:
        raise ApiError(exc.status, str(exc)) from None
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' must be a non-empty string", param="model")
    try:
        check_sampling(body)
    except SamplingError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    return body


async def route_request(state: RouterState, body: dict[str, Any], chat: bool, dry_run: bool = False) -> Decision:
    """The decision for a request; ``dry_run`` (/debug/route) changes no routing state and no metric."""
    served = state.fleet.served(body["model"])
    if served is None:
        raise no_worker_error(state, body["model"])
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
        raise ApiError(400, str(exc), param="messages" if chat else "prompt") from None
    except RecursionError:
        raise ApiError(400, TOO_DEEP) from None
    except (OSError, TokenizeFailed) as exc:  # ConnectionError, TimeoutError, a refused or failed /tokenize
        # The detail names the worker's address: the log's, not the client's.
        log.warning("tokenizing through worker %s failed: %s", workers[0].worker_id, exc)
        raise ApiError(502, "could not tokenize the prompt through a worker", "upstream_error") from None
    try:  # /debug/route (dry_run) shows the routing of any prompt; a real one is refused here
        check_context_length(body, len(tokens), None if dry_run else state.fleet.context_length(model))
    except SamplingError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(400, "'cache_salt' must be a non-empty string", param="cache_salt")
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


def no_worker_error(state: RouterState, model: str) -> ApiError:
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


async def proxy_completion(state: RouterState, incoming: HttpRequest, downstream: Downstream, chat: bool) -> None:
    """Route ``incoming`` and relay its reply to ``downstream``; ApiError for the client's
    mistakes and for what the router cannot do (no worker, every try failed). On a prefill/decode
    fleet the request may be split over two workers (:mod:`router.routing.pd`)."""
    body = await decoded(state, incoming.body)
    decision = await route_request(state, body, chat)
    plan = _plan(state, decision)
    if plan.split:
        # the client's body as sent, every field (``body`` keeps only those routing reads)
        await proxy_split(state, incoming, downstream, json.loads(incoming.body), decision, plan)
        return
    candidates = [s.candidate for s in plan.whole]
    if not candidates:
        raise ApiError(503, f"no alive worker serves whole requests of model {decision.model!r}", "service_unavailable")
    policy = state.settings.policy.value if not decision.degraded else "degraded"
    request_id = incoming.request_id

    def headers(candidate: Candidate) -> dict[str, str]:
        if not state.settings.routing_headers:
            return {"x-request-id": request_id}
        return {
            "x-kvroute-worker": candidate.worker_id,
            "x-kvroute-cached-tokens": str(predicted_cached_tokens(decision, candidate)),
            "x-request-id": request_id,
        }

    outgoing = Outgoing(incoming.path, incoming.headers, request_id, incoming.body)
    state.metrics.inflight.inc()
    try:
        streamed = body.get("stream") is True
        with Booking(decision, state.load, state.decider.learner_for(decision.model), streamed) as booking:
            failed = on_failure(state, decision, request_id)
            forwarded = await forward(outgoing, downstream, state.upstream, candidates, headers, booking, failed)
    except UpstreamFailed as exc:
        raise ApiError(502, str(exc), "upstream_error") from None
    finally:
        state.metrics.inflight.dec()
    if forwarded.retried:
        state.metrics.retries.inc()
    state.metrics.decisions.labels(decision.model, forwarded.candidate.worker_id, policy).inc()
    record_usage(state, decision, forwarded.candidate, forwarded.usage)
    reported = reported_cached(forwarded.usage)
    found = lost_split(decision, forwarded.candidate, reported)
    account(state, decision, forwarded.candidate, found)
    incoming.log_fields = {
        "model": decision.model,
        "worker": forwarded.candidate.worker_id,
        "prompt_tokens": decision.prompt_tokens,
        "degraded": decision.degraded,
        "predicted_cached_tokens": predicted_cached_tokens(decision, forwarded.candidate),
        "cached_tokens": reported,
        **log_fields(found),
        "decision_ms": round(decision.seconds * 1000, 3),
        "retried": forwarded.retried,
    }


def _plan(state: RouterState, decision: Decision) -> Plan:
    """Whole or split (a degraded decision, which read no match, is never split)."""
    if not state.fleet.disaggregated(decision.model) or state.settings.pd.mode is SplitMode.OFF:
        return Plan(False, list(decision.choice.ranked), [], [])  # the common case, at no cost
    roles = state.fleet.roles(decision.model)
    costs = state.settings.pd.unsplit() if decision.degraded else state.settings.pd
    model = state.decider.learner_for(decision.model).model
    policy = state.settings.policy
    baseline = None
    if policy in (Policy.ROUND_ROBIN, Policy.LEAST_LOADED):  # each leg by the policy's own rule
        baseline = Baseline(policy is Policy.ROUND_ROBIN, decision.turn, _rng)
    ranked, tokens, size = decision.choice.ranked, decision.prompt_tokens, decision.block_size
    residual_s = state.decider.decode_legs.residual_s(decision.model)
    return plan(ranked, roles, tokens, size, model, costs, _rng, baseline, residual_s)
