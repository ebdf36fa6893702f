"""Envoy's ext_proc messages as the endpoint picker reads and writes them (the Gateway API
Inference Extension's endpoint-picker protocol, v1.0.0): generated types from ``xds-protos``.

Read: a request's headers (``raw_value`` bytes, or ``value``), the endpoint subset the gateway may
hint (``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``) and the endpoint that
served (``envoy.lb`` / ``x-gateway-destination-endpoint-served``). Written: the pick, the same
``ip:port[,ip:port...]`` in the ``x-gateway-destination-endpoint`` header and in the ``envoy.lb``
dynamic metadata (the protocol forbids them to differ), and errors as an immediate response in
OpenAI's error shape.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from urllib.parse import urlsplit

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from router.http.edges import ApiError, error_body, error_headers

LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
FAIRNESS = "x-gateway-inference-fairness-id"
OBJECTIVE = "x-gateway-inference-objective"
MODEL_HEADER = "x-gateway-model-name"  # a header-only pick's model (no body to read it from)


def headers_of(message: base_pb2.HeaderMap) -> dict[str, str]:
    """The headers, names lower-cased; a repeated name keeps its last value."""
    return {h.key.lower(): (h.raw_value.decode("latin-1") if h.raw_value else h.value) for h in message.headers}


def endpoint_of(url: str) -> str:
    """A worker URL's ``host:port`` (the port its scheme implies when it names none)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def metadata_value(request: ext_proc.ProcessingRequest, namespace: str, key: str) -> struct_pb2.Value | None:
    fields = request.metadata_context.filter_metadata
    if namespace not in fields or key not in fields[namespace].fields:
        return None
    return fields[namespace].fields[key]


def subset_hint(request: ext_proc.ProcessingRequest) -> set[str] | None:
    """The endpoints the gateway allows this request (None: no hint, the whole pool)."""
    value = metadata_value(request, SUBSET_NAMESPACE, SUBSET)
    if value is None:
        return None
    if value.HasField("list_value"):
        return {v.string_value for v in value.list_value.values if v.string_value}
    return {part.strip() for part in value.string_value.split(",") if part.strip()}


def served_endpoint(request: ext_proc.ProcessingRequest) -> str | None:
    value = metadata_value(request, LB_NAMESPACE, SERVED)
    return value.string_value or None if value is not None else None


def _header_mutation(endpoints: Sequence[str]) -> ext_proc.HeaderMutation:
    value = base_pb2.HeaderValue(key=DESTINATION, raw_value=",".join(endpoints).encode())
    return ext_proc.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(header=value)])


def _destination_metadata(endpoints: Sequence[str]) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct(LB_NAMESPACE)[DESTINATION] = ",".join(endpoints)
    return metadata


def picked_in_headers(endpoints: Sequence[str]) -> ext_proc.ProcessingResponse:
    """The pick as the request headers' answer (a header-only or full-duplex exchange)."""
    common = ext_proc.CommonResponse(header_mutation=_header_mutation(endpoints), clear_route_cache=True)
    return ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(response=common),
        dynamic_metadata=_destination_metadata(endpoints),
    )


def picked_in_body(endpoints: Sequence[str]) -> ext_proc.ProcessingResponse:
    """The pick as a buffered body's answer (the headers were held back with it)."""
    common = ext_proc.CommonResponse(header_mutation=_header_mutation(endpoints), clear_route_cache=True)
    return ext_proc.ProcessingResponse(
        request_body=ext_proc.BodyResponse(response=common),
        dynamic_metadata=_destination_metadata(endpoints),
    )


def streamed_body(body: bytes, end: bool, request: bool = True) -> ext_proc.ProcessingResponse:
    """A full-duplex exchange's body passed on unchanged (that mode has the picker send it back)."""
    mutation = ext_proc.BodyMutation(streamed_response=ext_proc.StreamedBodyResponse(body=body, end_of_stream=end))
    answer = ext_proc.BodyResponse(response=ext_proc.CommonResponse(body_mutation=mutation))
    return (
        ext_proc.ProcessingResponse(request_body=answer)
        if request
        else ext_proc.ProcessingResponse(response_body=answer)
    )


def carry_on(phase: str) -> ext_proc.ProcessingResponse:
    """Nothing to change: ``phase`` is the ProcessingResponse field of the message answered."""
    if phase in ("request_trailers", "response_trailers"):
        return ext_proc.ProcessingResponse(**{phase: ext_proc.TrailersResponse()})
    if phase in ("request_headers", "response_headers"):
        return ext_proc.ProcessingResponse(**{phase: ext_proc.HeadersResponse()})
    return ext_proc.ProcessingResponse(**{phase: ext_proc.BodyResponse()})


def refusal(error: ApiError) -> ext_proc.ProcessingResponse:
    """``error`` as the gateway's immediate reply to the client, in OpenAI's error shape."""
    body = error_body(error.status, error.message, error.kind, error.param)
    pairs = {"content-type": "application/json", **error_headers(error)}
    headers = ext_proc.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=name.lower(), raw_value=value.encode()))
            for name, value in pairs.items()
        ]
    )
    immediate = ext_proc.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=error.status),  # type: ignore[arg-type]
        headers=headers,
        body=json.dumps(body).encode(),
        details=f"kvroute_epp_{error.status}",
    )
    return ext_proc.ProcessingResponse(immediate_response=immediate)
