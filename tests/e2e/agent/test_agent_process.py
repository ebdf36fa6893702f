"""The agent process's edges: flags and settings, ports already in use, its logs, a simulated
engine as a process of its own, and an --events endpoint that hears nothing."""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import subprocess
import sys
from collections.abc import Iterator

import aiohttp
import pytest

from kvroute.devstack.embedded_redis import free_port
from tests.support import ROOT, AgentProcess, wait_until
from tests.support.agent import BS, TOKENS, agent_args, registered, stored, wait_for_match


@pytest.mark.parametrize("entry", [["-m", "kvroute", "agent"], ["-m", "worker_agent"]])
def test_bad_arguments_exit_2_with_one_line(entry):
    result = run_agent_command([*entry, "--engine-url", "localhost:8000", "--events", "tcp://127.0.0.1:5557"])
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "--engine-url must be an http(s) URL, got 'localhost:8000'" in line


def run_agent_command(args: list[str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, *args] if args[0] == "-m" else [sys.executable, "-m", "worker_agent", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)


@contextlib.contextmanager
def port_in_use() -> Iterator[int]:
    """A port some other process listens on (on every address)."""
    with socket.create_server(("0.0.0.0", 0)) as taken:
        yield taken.getsockname()[1]


NOWHERE = ["--engine-url", "http://127.0.0.1:9/v1", "--redis-url", "redis://127.0.0.1:9/0"]  # never reached


def test_a_metrics_port_in_use_is_one_line_and_exit_2():
    with port_in_use() as port:
        args = [*NOWHERE, "--events", "tcp://127.0.0.1:9", "--metrics-host", "127.0.0.1", "--metrics-port", str(port)]
        result = run_agent_command(args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"python -m worker_agent: error: cannot listen on 127.0.0.1:{port} for the agent's /health and /metrics: "
        "the address is already in use; pass another --metrics-port or stop the process using it"
    ]


def test_an_events_port_in_use_is_one_line_and_exit_2():
    with port_in_use() as port:
        result = run_agent_command(
            [*NOWHERE, "--events", f"tcp://*:{port}", "--events-bind", "--metrics-port", str(free_port())]
        )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert f"cannot listen on tcp://*:{port} for the engine's KV events: the address is already in use" in line
    assert "pass another --events" in line and "Traceback" not in result.stderr


def test_a_bad_log_format_is_one_line_and_exit_2():
    result = run_agent_command([*NOWHERE, "--events", "tcp://127.0.0.1:9", "--log-format", "xml"])
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "--log-format must be one of text, json, not 'xml'" in line


def test_a_wildcard_events_endpoint_needs_events_bind():
    """Connect-only by default: a bound SUB would take KV events from any publisher reaching the port."""
    result = run_agent_command([*NOWHERE, "--events", "tcp://*:5557"])
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "--events tcp://*:5557 would make the agent listen for KV events from anyone" in line
    assert "--events-bind" in line and "Traceback" not in result.stderr


def test_a_wildcard_replay_endpoint_is_a_bad_setting():
    result = run_agent_command([*NOWHERE, "--events", "tcp://127.0.0.1:9", "--replay", "tcp://*:5558"])
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "--replay must name the engine's host" in line


async def test_json_logs_are_one_object_per_line_and_scrapes_log_at_debug(engine, server, index, unique_name):
    process = AgentProcess([*agent_args(engine, server.url), "--log-format", "json"]).start()
    try:
        await wait_until(lambda: registered(index, unique_name), 10)
        for _ in range(3):
            await process.metrics()
            await process.health()
        wrong_path = f"http://127.0.0.1:{process.metrics_port}/nope"
        async with aiohttp.ClientSession() as session, session.get(wrong_path) as response:
            assert response.status == 404
        await engine.publisher.publish([stored(0, 2)])
        await wait_for_match(index, unique_name, [2])
        assert process.terminate() == 0
    finally:
        process.kill()
    entries = [json.loads(line) for line in process.log().splitlines()]  # every line is one object
    assert all({"ts", "level", "logger", "message"} <= entry.keys() for entry in entries)
    assert any(e["level"] == "INFO" and e["message"].startswith("registered worker") for e in entries)
    requests = [e for e in entries if e["logger"] == "worker_agent.http"]
    scrapes = [e for e in requests if e["path"] in ("/metrics", "/health")]
    assert len(scrapes) >= 6 and {e["level"] for e in scrapes} == {"DEBUG"}  # kvservice.logs' record
    assert {"GET /metrics 200", "GET /health 200"} <= {e["message"] for e in scrapes}
    assert all(e["method"] == "GET" and e["status"] == 200 and e["ms"] >= 0 for e in scrapes)
    (wrong,) = [e for e in requests if e["path"] == "/nope"]  # not a probe: worth an INFO line
    assert wrong["level"] == "INFO" and wrong["status"] == 404 and wrong["message"] == "GET /nope 404"


def sim_engine_process(model: str, port: int, events: int, replay: int) -> subprocess.Popen[bytes]:
    """A simulated vLLM engine (`python -m sim_engine`) as a process of its own."""
    args = f"--port {port} --events-endpoint tcp://*:{events} --replay-endpoint tcp://*:{replay} --topic kv"
    args += f" --block-size {BS} --num-blocks 64 --speedup 50"
    return subprocess.Popen([sys.executable, "-m", "sim_engine", "--model", model, *args.split()], cwd=ROOT)


def sim_agent_args(port: int, events: int, replay: int, redis_url: str) -> list[str]:
    args = f"--engine-url http://127.0.0.1:{port}/v1 --events tcp://127.0.0.1:{events}"
    return [*args.split(), "--replay", f"tcp://127.0.0.1:{replay}", "--topic", "kv", "--redis-url", redis_url]


async def test_an_agent_follows_a_simulated_engine_process(unique_name, server, index):
    """A simulated engine and an agent, both real processes: what the demo runs."""
    port, events, replay = free_port(), free_port(), free_port()
    engine = sim_engine_process(unique_name, port, events, replay)
    args = [*sim_agent_args(port, events, replay, server.url), "--events-warn-after", "1"]
    process = AgentProcess(args).start()  # learns the model and the block size from the engine
    try:
        await wait_until(lambda: registered(index, unique_name), 30)
        body = {"model": unique_name, "prompt": TOKENS[: 10 * BS + 2], "max_tokens": 2}
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
            assert response.status == 200
        await wait_for_match(index, unique_name, [10])
        (record,) = await index.workers(unique_name)
        assert record.block_size == BS and record.url == f"http://127.0.0.1:{port}"

        async def hearing_events() -> bool:  # a loaded machine may delay an event past the 1 s warning
            _, health = await process.health()
            return health["events_silent"] is False and isinstance(health["seconds_since_event"], float)

        await wait_until(hearing_events, 10)
        assert await process.metric("kvroute_agent_last_event_timestamp_seconds") > 0
    finally:
        process.kill()
        engine.terminate()
        engine.wait(10)


async def test_an_agent_that_hears_no_events_from_a_working_engine_warns(unique_name, server, index):
    """--events names a port nobody publishes on: the engine serves requests, nothing arrives."""
    port, events, replay, wrong = free_port(), free_port(), free_port(), free_port()
    engine = sim_engine_process(unique_name, port, events, replay)
    args = [*sim_agent_args(port, wrong, replay, server.url), "--events-warn-after", "1"]
    process = AgentProcess(args).start()
    requests = itertools.count()
    try:
        await wait_until(lambda: registered(index, unique_name), 30)  # /metrics gives the block size
        _, health = await process.health()
        assert health["events_silent"] is False and health["seconds_since_event"] is None
        async with aiohttp.ClientSession() as session:

            async def silent() -> bool:  # keep the engine working until the agent speaks up
                body = {"model": unique_name, "prompt": [next(requests) + 1] * (3 * BS), "max_tokens": 1}
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
                    assert response.status == 200
                return (await process.health())[1]["events_silent"] is True

            await wait_until(silent, 30, interval=0.1)
        status, health = await process.health()
        assert status == 200 and health["events_endpoint"] == f"tcp://127.0.0.1:{wrong}"
        assert await process.metric("kvroute_agent_events_silent") == 1
        warnings = [line for line in process.log().splitlines() if " WARNING " in line and "no KV events" in line]
        assert len(warnings) == 1, process.log()
        assert f"tcp://127.0.0.1:{wrong}" in warnings[0] and "--events" in warnings[0] and "--topic" in warnings[0]
    finally:
        process.kill()
        engine.terminate()
        engine.wait(10)
