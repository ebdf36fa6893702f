"""The gateway's side of ext_proc, played by the tests (no Envoy binary can be installed here).

An :class:`EnvoyStream` opens one ``Process`` stream as Envoy's ext_proc filter does for one HTTP
request and sends its phases with the real message types (``xds-protos``): the request's headers
(with the protocol configuration and, when given, the endpoint subset hint), its body (whole, or
in chunks), then the reply's headers (with the served endpoint, when given) and body. It reads the
picker's answers the way each body mode has them come: buffered (headers answered at once, the pick
with the body), full-duplex streamed (the headers answered with the pick once the body is in, the
body sent back) or headers only. :func:`relay` plays the proxy in between: the request to the
picked worker, its reply back through the stream.

What it cannot prove about Envoy is listed in docs/kubernetes.md ("What the tests do not prove").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import json_format, struct_pb2

MODES = {
    "headers": ProcessingMode.NONE,
    "buffered": ProcessingMode.BUFFERED,
    "duplex": ProcessingMode.FULL_DUPLEX_STREAMED,
}


@dataclass
class Pick:
    endpoints: list[str] = field(default_factory=list)  # the x-gateway-destination-endpoint header's
    metadata: list[str] = field(default_factory=list)  # the envoy.lb dynamic metadata's
    status: int | None = None  # an immediate response's status
    error: dict[str, Any] | None = None  # and its body
    body_back: bytes = b""  # full duplex: the request body as the picker sent it back


def _header_map(headers: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])


def _metadata(namespace: str, key: str, value: Any) -> base_pb2.Metadata:
    inner = struct_pb2.Struct()
    inner.update({key: value})
    return base_pb2.Metadata(filter_metadata={namespace: inner})


class EnvoyStream:
    """One request's ext_proc stream, from Envoy's side."""

    def __init__(self, channel: grpc.aio.Channel, mode: str = "buffered") -> None:
        self._stub = ext_proc_grpc.ExternalProcessorStub(channel)
        self._mode = mode
        self._call: Any = None
        self.responses: list[ext_proc.ProcessingResponse] = []

    async def __aenter__(self) -> EnvoyStream:
        self._call = self._stub.Process()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._call is not None and not self._call.done():
            await self._call.done_writing()
            while await self._call.read() is not grpc.aio.EOF:
                pass

    async def status(self) -> grpc.StatusCode:
        """How the stream ended (waits for its end)."""
        return await self._call.code()

    def cancel(self) -> None:
        """The client went away: Envoy resets the stream."""
        self._call.cancel()

    async def _send(self, request: ext_proc.ProcessingRequest) -> None:
        await self._call.write(request)

    async def _read(self) -> ext_proc.ProcessingResponse:
        response = await self._call.read()
        assert response is not grpc.aio.EOF, "the picker ended the stream early"
        self.responses.append(response)
        return response

    async def request(
        self,
        path: str,
        body: dict[str, Any] | bytes | None,
        headers: dict[str, str] | None = None,
        chunk_size: int | None = None,
        subset: list[str] | None = None,
    ) -> Pick:
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        mode = MODES[self._mode]
        config = ext_proc.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode)
        all_headers = {":method": "POST", ":path": path, "content-type": "application/json", **(headers or {})}
        first = ext_proc.ProcessingRequest(
            request_headers=ext_proc.HttpHeaders(headers=_header_map(all_headers), end_of_stream=raw is None),
            protocol_config=config,
        )
        if subset is not None:
            first.metadata_context.CopyFrom(
                _metadata("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", subset)
            )
        await self._send(first)
        if raw is None or self._mode == "headers":
            return self._pick([await self._read()])
        if self._mode == "buffered":
            answer = await self._read()
            if answer.HasField("immediate_response"):
                return self._pick([answer])
        # Buffered, Envoy sends the whole body once; streamed, in the chunks it reads.
        streamed = chunk_size and self._mode == "duplex"
        chunks = [raw[i : i + chunk_size] for i in range(0, len(raw), chunk_size)] if streamed else [raw]
        for i, chunk in enumerate(chunks):
            end = i == len(chunks) - 1
            await self._send(ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=chunk, end_of_stream=end)))
        first_answer = await self._read()
        if self._mode == "buffered" or first_answer.HasField("immediate_response"):
            return self._pick([first_answer])
        return self._pick([first_answer, await self._read()])

    def _pick(self, answers: list[ext_proc.ProcessingResponse]) -> Pick:
        pick = Pick()
        for answer in answers:
            if answer.HasField("immediate_response"):
                pick.status = answer.immediate_response.status.code
                pick.error = json.loads(answer.immediate_response.body)
                continue
            phase = answer.WhichOneof("response")
            common = getattr(answer, phase).response
            for option in common.header_mutation.set_headers:
                if option.header.key == "x-gateway-destination-endpoint":
                    pick.endpoints = option.header.raw_value.decode().split(",")
            if common.body_mutation.HasField("streamed_response"):
                pick.body_back += common.body_mutation.streamed_response.body
            metadata = json_format.MessageToDict(answer.dynamic_metadata)
            if "envoy.lb" in metadata:
                pick.metadata = metadata["envoy.lb"]["x-gateway-destination-endpoint"].split(",")
        return pick

    async def reply(self, status: int, chunks: list[bytes], served: str | None = None) -> list[bytes]:
        """The worker's reply through the stream; what the picker sent back of its body."""
        await self.reply_headers(status, served, end=not chunks)
        return await self.reply_body(chunks)

    async def reply_headers(self, status: int, served: str | None = None, end: bool = False) -> None:
        """The reply's headers (with the endpoint that served, when given)."""
        headers = ext_proc.ProcessingRequest(
            response_headers=ext_proc.HttpHeaders(headers=_header_map({":status": str(status)}), end_of_stream=end)
        )
        if served is not None:
            headers.metadata_context.CopyFrom(_metadata("envoy.lb", "x-gateway-destination-endpoint-served", served))
        await self._send(headers)
        await self._read()

    async def reply_body(self, chunks: list[bytes]) -> list[bytes]:
        """The reply's body; what the picker sent back of it."""
        if self._mode == "headers" or not chunks:
            return []  # no body is sent to the picker in that mode
        if self._mode == "buffered":
            chunks = [b"".join(chunks)]  # Envoy buffers the whole body, then sends it once
        back = []
        for i, chunk in enumerate(chunks):
            end = i == len(chunks) - 1
            await self._send(ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=chunk, end_of_stream=end)))
            answer = await self._read()
            mutation = answer.response_body.response.body_mutation
            back.append(mutation.streamed_response.body if mutation.HasField("streamed_response") else chunk)
        return back


async def relay(stream: EnvoyStream, session: aiohttp.ClientSession, endpoint: str, path: str, body: dict) -> bytes:
    """Envoy's proxying: ``body`` to the picked endpoint, its reply through the stream; the reply."""
    async with session.post(f"http://{endpoint}{path}", json=body) as response:
        chunks = [chunk async for chunk in response.content.iter_any()]
        await stream.reply(response.status, chunks or [b""])
        return b"".join(chunks)
