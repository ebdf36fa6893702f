"""The wire of prefill/decode disaggregation (sim_engine/kv_transfer.py): a request's
``kv_transfer_params`` as vLLM's OpenAI server takes them, and the private endpoints between
engines (``POST /kv_transfer/pull``, ``POST /kv_transfer/heartbeat``), mounted with ``--kv-transfer``.
"""

from __future__ import annotations

import json
from typing import Any, TypeGuard

from aiohttp import web

from sim_engine import api
from sim_engine.kv_transfer import HEARTBEAT_PATH, PULL_PATH, KVConnector, TransferError
from sim_engine.types import RemotePrefill, SimRequest

CONNECTOR = web.AppKey("kv_connector", KVConnector)
PARAM = "kv_transfer_params"
REMOTE_FIELDS = "remote_engine_id, remote_request_id, remote_block_ids, remote_host and remote_port"


def new_request(
    connector: KVConnector | None, request_id: str, prompt: list[int], generation: api.Generation
) -> SimRequest:
    """The engine's request for one prompt, with its ``kv_transfer_params`` when the engine has a
    connector (without one they are ignored, as vLLM ignores them without a KV connector)."""
    request = SimRequest(request_id, prompt, generation.max_tokens, generation.keys)
    params = generation.kv_transfer_params
    if connector is None or params is None:
        return request
    if not isinstance(params, dict):
        raise api.ApiError(400, f"'{PARAM}' must be an object", PARAM)
    request.remote_decode = bool(params.get("do_remote_decode"))
    if params.get("do_remote_prefill"):
        request.remote = remote_prefill(params)
    return request


def remote_prefill(params: dict[str, Any]) -> RemotePrefill:
    """A decode leg's source, from the parameters a prefill engine's reply gave (400 when they do
    not name one: vLLM would wait for a transfer it never starts)."""
    strings = [params.get(key) for key in ("remote_engine_id", "remote_request_id", "remote_host")]
    port, block_ids = params.get("remote_port"), _block_ids(params.get("remote_block_ids"))
    if not all(isinstance(s, str) and s for s in strings) or not _port(port) or block_ids is None:
        raise api.ApiError(
            400, f"'{PARAM}' with do_remote_prefill needs {REMOTE_FIELDS}, as a prefill engine's reply gives", PARAM
        )
    engine_id, request_id, host = (str(s) for s in strings)
    cached = params.get("remote_prefill_cached_tokens")
    return RemotePrefill(engine_id, request_id, block_ids, host, port, cached if _is_int(cached) else None)


def _block_ids(value: Any) -> list[int] | None:
    """vLLM 0.32 sends one list per KV-cache group (the first: full attention); older ones a list."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        value = value[0]
    if isinstance(value, list) and all(_is_int(b) for b in value):
        return list(value)
    return None


def _port(value: Any) -> TypeGuard[int]:
    return _is_int(value) and 0 < value < 65536


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def add_routes(app: web.Application, connector: KVConnector) -> None:
    app[CONNECTOR] = connector
    app.router.add_post(PULL_PATH, _pull)
    app.router.add_post(HEARTBEAT_PATH, _heartbeat)


def _error(status: int, message: str) -> web.Response:
    return web.json_response(api.ApiError(status, message).body(), status=status)


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("remote_engine_id"), str):
        raise api.ApiError(400, "the body must be an object with a string 'remote_engine_id'")
    return body


async def _pull(request: web.Request) -> web.Response:
    """A decode engine reads a prefill leg's blocks (the read lasts ``read_s``; then they are freed)."""
    try:
        body = await _body(request)
        block_ids, read_s = _block_ids(body.get("remote_block_ids") or []), body.get("read_s", 0.0)
        if block_ids is None or not isinstance(body.get("remote_request_id"), str):
            raise api.ApiError(400, "'remote_request_id' must be a string and 'remote_block_ids' block ids")
        if not isinstance(read_s, int | float) or isinstance(read_s, bool) or not 0 <= read_s < float("inf"):
            raise api.ApiError(400, "'read_s' must be a number of seconds >= 0")
    except api.ApiError as exc:
        return _error(exc.status, exc.message)
    connector = request.app[CONNECTOR]
    try:
        tokens = await connector.serve_pull(body["remote_engine_id"], body["remote_request_id"], block_ids, read_s)
    except TransferError as exc:
        return _error(404, str(exc))
    return web.json_response({"token_ids": tokens})


async def _heartbeat(request: web.Request) -> web.Response:
    """A decode engine still holds requests for these blocks: their lease is extended."""
    try:
        body = await _body(request)
        ids = body.get("request_ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise api.ApiError(400, "'request_ids' must be a list of strings")
    except api.ApiError as exc:
        return _error(exc.status, exc.message)
    connector = request.app[CONNECTOR]
    if body["remote_engine_id"] == connector.engine_id:
        connector.extend(ids)
    return web.Response(status=200)
