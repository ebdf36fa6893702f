"""The router's answers to mistakes and outages: one clear line, the right status, no traceback.

Real Redis servers, real router processes and real HTTP; the routing itself is tested in
test_routing.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys

import aiohttp
from redis.asyncio import Redis

from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvindex.types import WorkerInfo
from kvroute.devstack.embedded_redis import RedisServer, available_servers, free_port
from router.main import running_router
from router.settings import RouterSettings
from tests.support import ROOT, SimFleet, wait_until


def _server(port: int | None = None) -> RedisServer:
    servers = available_servers()
    binary = servers.get("redis") or servers["valkey"]
    return RedisServer(binary=binary, port=port) if port else RedisServer(binary=binary)


async def _get(url: str) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, dict(response.headers), await response.json(content_type=None)


async def _post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, await response.json(content_type=None)


async def _register(redis_url: str, model: str = "tiny") -> None:
    """A worker record with a long heartbeat (its URL answers nothing: enough for the fleet view)."""
    client = Redis.from_url(redis_url)
    try:
        await RedisIndex(client).register(WorkerInfo("w1", model, f"http://127.0.0.1:{free_port()}", 16), 60_000)
    finally:
        await client.aclose()


def _router_command(redis_url: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "router", "--redis-url", redis_url, "--port", str(port), *extra]


def test_a_port_in_use_is_one_line_and_exit_2(redis_server):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            _router_command(redis_server.url, port), cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    assert result.returncode == 2, result.stderr
    errors = [line.split(": ", 1)[1] for line in result.stderr.splitlines() if ": error: " in line]
    assert errors == [
        f"error: cannot listen on 127.0.0.1:{port} for the router's HTTP API: the address is "
        "already in use; pass another --port (or --host) or stop the process using it"
    ]
    assert "Traceback" not in result.stderr and "Unclosed" not in result.stderr


async def test_started_while_redis_is_down_it_says_503_and_why_then_recovers():
    server = _server()  # not started yet: its port refuses connections
    settings = RouterSettings(redis=RedisSettings(url=server.url), port=0, workers_refresh_s=0.2)
    async with running_router(settings) as router:
        status, body = await _post(router.url + "/v1/completions", {"model": "tiny", "prompt": "hi"})
        assert status == 503
        message = body["error"]["message"]
        # Where Redis is goes to the log, never to clients (issue 14: no internal addresses).
        assert "no view of the workers" in message and str(server.port) not in message, message
        status, _, ready = await _get(router.url + "/ready")
        assert status == 503 and ready["ready"] is False and "Redis unreachable" in ready["reason"]
        assert str(server.port) not in ready["reason"], ready
        assert (await _get(router.url + "/health"))[0] == 200  # alive: only not ready
        server.start()
        try:
            await _register(server.url)

            async def ready_now() -> bool:
                return (await _get(router.url + "/ready"))[0] == 200

            await wait_until(ready_now, 10)
            status, body = await _post(router.url + "/v1/completions", {"model": "nope", "prompt": "hi"})
            assert status == 404 and body["error"]["type"] == "not_found_error"
            assert body["error"]["message"] == "The model `nope` does not exist. Models served: tiny."
        finally:
            server.stop()


async def test_ready_stays_true_while_degraded_and_degraded_mode_is_logged(redis_server, caplog):
    caplog.set_level(logging.INFO, logger="router.decide")
    fleet = await SimFleet(redis_server.url, count=2).start()
    settings = RouterSettings(redis=RedisSettings(url=redis_server.url), port=0, workers_refresh_s=0.2)
    try:
        async with running_router(settings) as router:

            async def both_workers() -> bool:
                return len(router.state.fleet.alive("tiny")) == 2

            await wait_until(both_workers, 20)
            redis_server.stop(kill=True)
            for i in range(5):
                status, _ = await _post(router.url + "/v1/completions", {"model": "tiny", "prompt": [1, 2, i]})
                assert status == 200
            status, _, ready = await _get(router.url + "/ready")
            assert status == 200 and ready["ready"] is True and ready["degraded"] is True
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "degraded mode" in r.message]
            assert len(warnings) == 1, [r.message for r in caplog.records]  # once, not once per request

            redis_server.start()

            async def back() -> bool:
                await _post(router.url + "/v1/completions", {"model": "tiny", "prompt": [3, 4]})
                return not router.state.decider.degraded

            await wait_until(back, 20)
            over = [r for r in caplog.records if r.levelno == logging.INFO and "degraded mode over" in r.message]
            assert len(over) == 1
    finally:
        await fleet.stop()


async def test_unknown_paths_and_methods_get_openai_errors_and_no_metric_series(redis_server):
    await _register(redis_server.url)
    async with running_router(RouterSettings(redis=RedisSettings(url=redis_server.url), port=0)) as router:
        status, _, body = await _get(router.url + "/no/such/path-12345")
        assert status == 404 and body["error"]["code"] == 404
        assert body["error"]["message"] == "no such endpoint: GET /no/such/path-12345"
        status, headers, body = await _get(router.url + "/v1/completions")
        assert status == 405 and headers["Allow"] == "POST" and body["error"]["code"] == 405
        async with aiohttp.ClientSession() as session, session.get(router.url + "/metrics") as response:
            metrics = await response.text()
        assert 'endpoint="unmatched",status="404"' in metrics
        assert 'endpoint="unmatched",status="405"' in metrics
        assert "path-12345" not in metrics


async def test_json_logs_are_one_object_per_line_and_probes_are_quiet(redis_server):
    await _register(redis_server.url)
    port = free_port()
    env = {**os.environ, "KVROUTE_LOG_FORMAT": "json"}  # the variable works as the flag does
    process = subprocess.Popen(  # noqa: ASYNC220 - starting it does not block
        _router_command(redis_server.url, port),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        async def ready() -> bool:
            try:
                return (await _get(url + "/ready"))[0] == 200
            except aiohttp.ClientError:
                return False

        await wait_until(ready, 30)
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
            assert response.status == 200
        assert (await _post(url + "/v1/completions", {"model": "nope", "prompt": "x"}))[0] == 404
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(process.communicate, timeout=30)
    assert process.returncode == 0, stderr
    lines = [json.loads(line) for line in stderr.splitlines()]  # every line is one JSON object
    access = [entry for entry in lines if entry["logger"] == "router.access"]
    assert [(a["method"], a["path"], a["status"]) for a in access] == [("POST", "/v1/completions", 404)]
    assert {"ts", "level", "message", "request_id", "ms"} <= set(access[0])
    assert any(entry["level"] == "INFO" and "router" in entry["message"] for entry in lines)
