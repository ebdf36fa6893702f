"""One request's ext_proc stream, as the endpoint picker follows it.

Envoy opens one bidirectional stream per HTTP request and sends its phases in order: the request's
headers, its body (whole when buffered, in chunks when streamed), the reply's headers and body.
The picker answers each phase it is sent:

* the pick is made when the prompt is known: with the body's last chunk (buffered, or full-duplex
  streamed: then the held headers are answered with the pick and the body is sent back unchanged),
  or with the headers when no body comes (``x-gateway-model-name`` names the model, the prompt is
  empty: a pick by load alone);
* it is the HTTP router's decision (:func:`router.completions.route_request`): the same index,
  load, learned cost, tiers and adapters; the chosen worker and up to ``FALLBACKS`` next ones go
  to the gateway, best first, within the subset it hinted;
* the request's load is booked on the chosen worker (on the one that served, when the gateway
  fell back) and released as the reply goes: its first byte, then its end, where its ``usage``
  (the engine's cached tokens) teaches the prediction and the accounting; a stream that ends
  before the reply does (the client went away, the gateway reset) releases it too.

Errors are the gateway's immediate reply in OpenAI's shape: 400 for a malformed body, 404 for an
unknown model, 503 when no worker can take it, 429 past ``--max-inflight``.
"""

from __future__ import annotations

import logging
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from router.completions import decoded, no_worker_error, route_request
from router.epp import wire
from router.http.edges import ApiError
from router.outcomes import account, record_usage, reported_cached
from router.routing.accounting import lost_split
from router.routing.booking import Booking
from router.routing.decision import Decision, predicted_cached_tokens
from router.routing.scoring import Candidate
from router.state import RouterState
from router.upstream.usage import SseUsage, usage_from_json

log = logging.getLogger("router.epp")
FALLBACKS = 2  # workers named after the chosen one, for the gateway's retries
MAX_REPLY_READ = 4 << 20  # a whole reply's bytes kept to read its usage; past it, none is read
BUFFERED, FULL_DUPLEX = ProcessingMode.BUFFERED, ProcessingMode.FULL_DUPLEX_STREAMED
NO_BODY = ProcessingMode.NONE


class Exchange:
    """The picker's side of one ext_proc stream (:mod:`router.epp.server` makes one per stream)."""

    def __init__(self, state: RouterState, inflight: list[int]) -> None:
        self._state = state
        self._inflight = inflight  # the picker's exchanges holding a booking now, shared
        self._request_mode: int = BUFFERED
        self._response_mode: int = ProcessingMode.NONE
        self._headers: dict[str, str] = {}
        self._subset: set[str] | None = None
        self._body = bytearray()
        self._decision: Decision | None = None
        self._booking: Booking | None = None
        self._serving: Candidate | None = None  # the worker booked (the gateway's choice among the named)
        self._streamed = False
        self._status = 0
        self._reply = bytearray()
        self._sse = SseUsage()
        self._done = False

    async def answer(self, request: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        """What to send back for ``request`` (one message of the stream), in order."""
        if request.HasField("protocol_config"):
            self._request_mode = request.protocol_config.request_body_mode
            self._response_mode = request.protocol_config.response_body_mode
        phase = request.WhichOneof("request")
        try:
            if phase == "request_headers":
                return await self._on_request_headers(request)
            if phase == "request_body":
                return await self._on_request_body(request.request_body)
            if phase == "response_headers":
                return self._on_response_headers(request)
            if phase == "response_body":
                return self._on_response_body(request.response_body)
        except ApiError as exc:
            return [wire.refusal(exc)]
        return [wire.carry_on(phase)] if phase else []

    async def _on_request_headers(self, request: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        self._headers = wire.headers_of(request.request_headers.headers)
        self._subset = wire.subset_hint(request)
        if request.request_headers.end_of_stream or self._request_mode == NO_BODY or not self._completion_path():
            return [wire.picked_in_headers(await self._pick(None))]
        if self._request_mode == FULL_DUPLEX:
            return []  # the headers are answered with the pick, once the body is in
        return [wire.carry_on("request_headers")]

    async def _on_request_body(self, body: ext_proc.HttpBody) -> list[ext_proc.ProcessingResponse]:
        self._body += body.body
        if len(self._body) > self._state.settings.max_body_bytes:
            raise ApiError(413, f"the request body is larger than {self._state.settings.max_body_bytes} bytes")
        if not (body.end_of_stream or body.end_of_stream_without_message):
            return [] if self._request_mode == FULL_DUPLEX else [wire.carry_on("request_body")]
        endpoints = await self._pick(bytes(self._body))
        if self._request_mode == FULL_DUPLEX:
            return [wire.picked_in_headers(endpoints), wire.streamed_body(bytes(self._body), True)]
        return [wire.picked_in_body(endpoints)]

    def _completion_path(self) -> bool:
        path = self._headers.get(":path", "").partition("?")[0]
        return path.endswith(("/completions", "/chat/completions"))

    async def _pick(self, body: bytes | None) -> list[str]:
        """The decision, booked on its worker; the endpoints to name, best first."""
        if self._booking is not None:
            return [wire.endpoint_of(self._serving.url)] if self._serving is not None else []
        state = self._state
        if self._inflight[0] >= state.settings.max_inflight:
            raise ApiError(429, "the router is at its limit of requests in flight; retry shortly", "rate_limit_error")
        decision = await (self._decide_on_headers() if body is None else self._decide_on_body(body))
        ranked = [scored.candidate for scored in decision.choice.ranked]
        if self._subset is not None:
            ranked = [c for c in ranked if wire.endpoint_of(c.url) in self._subset]
            if not ranked:
                raise ApiError(503, "none of the endpoints the gateway allows serves this model", "service_unavailable")
        self._decision, self._serving = decision, ranked[0]
        self._booking = Booking(decision, state.load, state.decider.learner_for(decision.model), self._streamed)
        self._booking.attempt(ranked[0])
        self._inflight[0] += 1
        state.metrics.inflight.inc()
        return [wire.endpoint_of(c.url) for c in ranked[: 1 + FALLBACKS]]

    async def _decide_on_body(self, raw: bytes) -> Decision:
        body = await decoded(self._state, raw)
        self._streamed = body.get("stream") is True
        chat = self._headers.get(":path", "").partition("?")[0].endswith("/chat/completions")
        return await route_request(self._state, body, chat)

    async def _decide_on_headers(self) -> Decision:
        """A pick with no prompt: the model from ``x-gateway-model-name``, or the fleet's only one."""
        fleet = self._state.fleet
        model = self._headers.get(wire.MODEL_HEADER)
        if model is None:
            served_models = fleet.models_with_workers()
            if len(served_models) != 1:
                raise ApiError(400, f"a pick without a body needs the {wire.MODEL_HEADER} header", param="model")
            model = served_models[0]
        served = fleet.served(model)
        if served is None:
            raise no_worker_error(self._state, model)
        return await self._state.decider.decide(served.model, [], adapter=served.adapter)

    def _on_response_headers(self, request: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        headers = wire.headers_of(request.response_headers.headers)
        self._status = int(headers.get(":status", "0") or 0)
        self._follow_fallback(wire.served_endpoint(request))
        if self._booking is not None and self._serving is not None:
            if self._status >= 500:
                self._booking.failed(self._serving)
            else:
                self._booking.prefilled(self._serving)
        if request.response_headers.end_of_stream:
            self._finish()
        return [wire.carry_on("response_headers")]

    def _follow_fallback(self, served: str | None) -> None:
        """The gateway sent the request to a fallback: the booking moves there."""
        if served is None or self._decision is None or self._booking is None or self._serving is None:
            return
        if wire.endpoint_of(self._serving.url) == served:
            return
        moved = next(
            (s.candidate for s in self._decision.choice.ranked if wire.endpoint_of(s.candidate.url) == served), None
        )
        if moved is not None:
            self._booking.failed(self._serving)
            self._booking.attempt(moved)
            self._serving = moved

    def _on_response_body(self, body: ext_proc.HttpBody) -> list[ext_proc.ProcessingResponse]:
        if self._streamed:
            self._sse.feed(body.body)
        elif len(self._reply) + len(body.body) <= MAX_REPLY_READ:
            self._reply += body.body
        end = body.end_of_stream or body.end_of_stream_without_message
        if end:
            self._finish()
        if self._response_mode == FULL_DUPLEX:
            return [wire.streamed_body(body.body, end, request=False)]
        return [wire.carry_on("response_body")]

    def _usage(self) -> dict | None:
        return self._sse.usage if self._streamed else usage_from_json(bytes(self._reply))

    def _finish(self) -> None:
        """The reply is over: what it taught, and the booking closed."""
        if self._done or self._booking is None or self._decision is None or self._serving is None:
            return
        self._done = True
        state, decision, candidate = self._state, self._decision, self._serving
        usage = self._usage() if self._status < 400 else None
        if usage is not None:
            self._booking.replied(candidate, usage)
            record_usage(state, decision, candidate, usage)
            account(state, decision, candidate, lost_split(decision, candidate, reported_cached(usage)))
        policy = state.settings.policy.value if not decision.degraded else "degraded"
        state.metrics.decisions.labels(decision.model, candidate.worker_id, policy).inc()
        self._release()
        log.info("picked", extra={"fields": self._log_fields(candidate, usage)})

    def _log_fields(self, candidate: Candidate, usage: dict | None) -> dict[str, Any]:
        assert self._decision is not None
        return {
            "model": self._decision.model,
            "worker": candidate.worker_id,
            "status": self._status,
            "prompt_tokens": self._decision.prompt_tokens,
            "predicted_cached_tokens": predicted_cached_tokens(self._decision, candidate),
            "cached_tokens": reported_cached(usage),
            "degraded": self._decision.degraded,
            "fairness_id": self._headers.get(wire.FAIRNESS),
            "objective": self._headers.get(wire.OBJECTIVE),
        }

    def _release(self) -> None:
        if self._booking is not None:
            self._booking.close()
            self._booking = None
            self._inflight[0] -= 1
            self._state.metrics.inflight.dec()

    def close(self) -> None:
        """The stream ended (the reply's end, or a client or gateway that went away first)."""
        self._release()
