"""router.epp.wire: the ext_proc messages the endpoint picker reads and writes (GIE's protocol)."""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.protobuf import json_format, struct_pb2

from router.epp import wire
from router.http.edges import ApiError


def _with_metadata(namespace: str, key: str, value: object) -> ext_proc.ProcessingRequest:
    inner = struct_pb2.Struct()
    inner.update({key: value})
    request = ext_proc.ProcessingRequest()
    request.metadata_context.CopyFrom(base_pb2.Metadata(filter_metadata={namespace: inner}))
    return request


def test_a_workers_endpoint_is_host_and_port():
    assert wire.endpoint_of("http://10.0.0.5:8000") == "10.0.0.5:8000"
    assert wire.endpoint_of("http://10.0.0.5") == "10.0.0.5:80"
    assert wire.endpoint_of("https://vllm.example") == "vllm.example:443"
    assert wire.endpoint_of("http://[fd00::5]:8000") == "[fd00::5]:8000"


def test_headers_are_read_from_raw_values_or_values_lower_cased():
    headers = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":Path", raw_value=b"/v1/completions"),
            base_pb2.HeaderValue(key="X-A", value="b"),
        ]
    )
    assert wire.headers_of(headers) == {":path": "/v1/completions", "x-a": "b"}


def test_the_subset_hint_and_the_served_endpoint():
    assert wire.subset_hint(ext_proc.ProcessingRequest()) is None
    hinted = _with_metadata(wire.SUBSET_NAMESPACE, wire.SUBSET, ["10.0.0.1:8000", "10.0.0.2:8000"])
    assert wire.subset_hint(hinted) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert wire.subset_hint(_with_metadata(wire.SUBSET_NAMESPACE, wire.SUBSET, [])) == set()  # none eligible
    assert wire.served_endpoint(_with_metadata(wire.LB_NAMESPACE, wire.SERVED, "10.0.0.2:8000")) == "10.0.0.2:8000"
    assert wire.served_endpoint(ext_proc.ProcessingRequest()) is None


def test_the_pick_is_the_same_in_the_header_and_the_metadata():
    for answer, phase in (
        (wire.picked_in_body(["a:1", "b:2"]), "request_body"),
        (wire.picked_in_headers(["a:1", "b:2"]), "request_headers"),
    ):
        common = getattr(answer, phase).response
        (option,) = common.header_mutation.set_headers
        assert (option.header.key, option.header.raw_value) == ("x-gateway-destination-endpoint", b"a:1,b:2")
        assert json_format.MessageToDict(answer.dynamic_metadata) == {
            "envoy.lb": {"x-gateway-destination-endpoint": "a:1,b:2"}
        }


def test_a_refusal_is_openais_error_shape_with_its_status():
    answer = wire.refusal(ApiError(429, "busy", "rate_limit_error"))
    immediate = answer.immediate_response
    assert immediate.status.code == 429
    assert json.loads(immediate.body) == {
        "error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": 429}
    }
    headers = {o.header.key: o.header.raw_value for o in immediate.headers.set_headers}
    assert headers["content-type"] == b"application/json" and headers["retry-after"] == b"1"
