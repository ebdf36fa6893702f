"""A completion split over a prefill worker and a decode worker (:mod:`router.routing.pd` chose
to split it and the two workers; :mod:`router.upstream.split` sends the legs).

Each leg has its own :class:`~router.routing.booking.Booking`: the prefill leg books the prompt's
uncached tokens on the prefill worker until its one-token reply comes, and teaches the TTFT model
there (that reply's time is the prefill's); the decode leg books a request that computes next to
nothing on the decode worker, and teaches nothing (its first byte waits for a transfer, not a
prefill). Both mark the prompt's blocks
expected where they go: each engine holds them afterwards. The accounting (predicted against
reported cached tokens, the lost-token split) is the prefill worker's: that is where the prompt's
cache was used.
"""

from __future__ import annotations

import contextlib
from typing import Any

from router.http.edges import ApiError
from router.http.wire import HttpRequest
from router.outcomes import account, log_fields, on_failure, record_usage
from router.routing.accounting import lost_split
from router.routing.booking import Booking
from router.routing.decision import Decision, predicted_cached_tokens
from router.routing.pd import Plan, decode_leg_s
from router.routing.scoring import Candidate
from router.state import RouterState
from router.upstream import split
from router.upstream.proxy import Downstream, Outgoing, UpstreamFailed


async def proxy_split(
    state: RouterState,
    incoming: HttpRequest,
    downstream: Downstream,
    body: dict[str, Any],
    decision: Decision,
    plan: Plan,
) -> None:
    request_id = incoming.request_id
    failed = on_failure(state, decision, request_id)
    learner = state.decider.learner_for(decision.model)
    state.metrics.inflight.inc()
    try:
        # A one-token reply comes when the prefill is done: its first byte is the prefill's end, as
        # a stream's is (not a whole reply, whose prefill would be released at a predicted time).
        with Booking(decision, state.load, learner, streamed=True) as booking:
            leg = Outgoing(incoming.path, incoming.headers, request_id, split.prefill_body(body))
            prefilled = await split.prefill(leg, state.upstream, [s.candidate for s in plan.prefill], booking, failed)
        decoders = _decoders(plan, prefilled.candidate)
        leg = Outgoing(
            incoming.path, incoming.headers, request_id, split.decode_leg_body(body, prefilled.kv_transfer_params)
        )

        def headers(decoder: Candidate) -> dict[str, str]:
            return _reply_headers(state, decision, prefilled.candidate, decoder, request_id)

        with Booking(decision, state.load, None, body.get("stream") is True) as booking:
            reply = (headers, prefilled.cached_tokens)
            decoder, _, first_byte_s = await split.decode(
                leg, downstream, state.upstream, decoders, reply, booking, failed
            )
        if first_byte_s is not None:  # a stream's decode leg: what it took against its prediction
            predicted = _predicted_leg_s(state, decision, plan, decoder)
            state.decider.decode_legs.observe(decision.model, predicted, first_byte_s)
    except split.ClientMistake as exc:
        with contextlib.suppress(ConnectionError):
            await downstream.send_whole(exc.status, exc.headers, exc.body)
        return
    except UpstreamFailed as exc:
        raise ApiError(502, str(exc), "upstream_error") from None
    finally:
        state.metrics.inflight.dec()
    _accounted(state, incoming, decision, prefilled, decoder)


def _predicted_leg_s(state: RouterState, decision: Decision, plan: Plan, decoder: Candidate) -> float:
    scored = next(s for s in plan.decode if s.candidate.worker_id == decoder.worker_id)
    model = state.decider.learner_for(decision.model).model
    return decode_leg_s(scored, decision.prompt_tokens, decision.block_size, model, state.settings.pd)


def _decoders(plan: Plan, prefill: Candidate) -> list[Candidate]:
    """The decode workers, best first, but the prefill worker (a retried prefill may have landed
    on one of them, when it serves both legs)."""
    decoders = [s.candidate for s in plan.decode if s.candidate.worker_id != prefill.worker_id]
    if not decoders:
        raise UpstreamFailed("no decode worker is left beside the prefill worker")
    return decoders


def _reply_headers(
    state: RouterState, decision: Decision, prefill: Candidate, decoder: Candidate, request_id: str
) -> dict[str, str]:
    if not state.settings.routing_headers:
        return {"x-request-id": request_id}
    return {
        "x-kvroute-worker": decoder.worker_id,
        "x-kvroute-prefill-worker": prefill.worker_id,
        "x-kvroute-cached-tokens": str(predicted_cached_tokens(decision, prefill)),
        "x-request-id": request_id,
    }


def _accounted(
    state: RouterState,
    incoming: HttpRequest,
    decision: Decision,
    prefilled: split.Prefilled,
    decoder: Candidate,
) -> None:
    policy = state.settings.policy.value
    prefill = prefilled.candidate
    if prefilled.retried:
        state.metrics.retries.inc()
    state.metrics.decisions.labels(decision.model, decoder.worker_id, policy).inc()
    state.metrics.split_requests.labels(decision.model).inc()
    record_usage(state, decision, prefill, prefilled.usage)
    reported = prefilled.cached_tokens
    found = lost_split(decision, prefill, reported)
    account(state, decision, prefill, found)
    incoming.log_fields = {
        "model": decision.model,
        "worker": decoder.worker_id,
        "prefill_worker": prefill.worker_id,
        "prompt_tokens": decision.prompt_tokens,
        "degraded": decision.degraded,
        "predicted_cached_tokens": predicted_cached_tokens(decision, prefill),
        "cached_tokens": reported,
        **log_fields(found),
        "decision_ms": round(decision.seconds * 1000, 3),
        "retried": prefilled.retried,
    }
