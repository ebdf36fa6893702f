"""The simulated engine as a process and its start-up: entry points, ports in use (one line, exit
2), several engines on default ports, JSON logs, and a failed start that leaves nothing behind."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest

from kvroute.devstack.embedded_redis import free_port
from kvservice.lifecycle import StartupError
from sim_engine.server import running_engine
from sim_engine.settings import EVENTS_PORT_OFFSET, SimEngineSettings
from tests.e2e.test_sim_engine import post, settings
from tests.support import ROOT, wait_until

SIM = [sys.executable, "-m", "sim_engine"]
KVROUTE_SIM = [sys.executable, "-m", "kvroute", "sim-engine"]


async def wait_serving(url: str, within: float = 30) -> None:
    async def up() -> bool:
        try:
            status, body = await post(url, {"prompt": "hello", "max_tokens": 2})
        except aiohttp.ClientError:
            return False
        return status == 200 and body["usage"]["completion_tokens"] == 2

    await wait_until(up, within)


@pytest.mark.parametrize("command", [KVROUTE_SIM, SIM], ids=["kvroute sim-engine", "python -m sim_engine"])
def test_the_command_line_engine_serves_and_rejects_bad_flags(command):
    for flags, message in (
        (["--num-blocks", "1"], "--num-blocks must be >= 2"),
        (["--port", "80"], "--port 80 has no default KV-event port"),
        (["--events-endpoint", "none", "--replay-endpoint", "tcp://*:5558"], "--replay-endpoint needs KV events"),
        (["--log-format", "xml"], "--log-format must be one of text, json"),
        (["--max-num-batched-tokens", "8", "--max-num-seqs", "16"], "(8) must be >= --max-num-seqs (16)"),
    ):
        bad = subprocess.run([*command, *flags], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and message in bad.stderr, (flags, bad.stderr)
    port = free_port()
    process = subprocess.Popen([*command, "--port", str(port), "--events-endpoint", "none"], cwd=ROOT)
    try:
        asyncio.run(wait_serving(f"http://127.0.0.1:{port}"))
    finally:
        process.terminate()
        assert process.wait(10) == 0


@contextmanager
def busy_port() -> Iterator[int]:
    """A port another process would hold: a listening socket on every interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize("flag", ["--port", "--events-endpoint", "--replay-endpoint"])
def test_a_port_in_use_is_one_line_naming_the_flag_and_exit_2(flag):
    with busy_port() as taken:
        flags = {
            "--port": str(free_port()),
            "--events-endpoint": f"tcp://*:{free_port()}",
            "--replay-endpoint": f"tcp://*:{free_port()}",
        }
        flags[flag] = str(taken) if flag == "--port" else f"tcp://*:{taken}"
        argv = [*SIM, *(item for pair in flags.items() for item in pair)]
        result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("python -m sim_engine: error: cannot listen on"), line
    assert f":{taken} " in line and "already in use" in line and f"pass another {flag}" in line


def port_with_free_default_events_port() -> int:
    """A free HTTP port whose default KV-event port (port - 2443) is free too."""
    while True:
        port = free_port()
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("0.0.0.0", port - EVENTS_PORT_OFFSET))
        except OSError:
            continue
        return port


def json_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def scrape_and_complete(url: str) -> None:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        assert response.status == 200
    status, _ = await post(url, {"prompt": "hello", "max_tokens": 1})
    assert status == 200


def test_two_engines_with_default_event_ports_both_serve_and_log_json(tmp_path):
    """Engines on different --port values never share a default KV-event port."""
    ports = [port_with_free_default_events_port() for _ in range(2)]
    logs = [tmp_path / f"engine-{port}.log" for port in ports]
    processes = []
    for command, port, log in zip((KVROUTE_SIM, SIM), ports, logs, strict=True):
        with log.open("wb") as stderr:
            argv = [*command, "--port", str(port), "--log-format", "json"]
            processes.append(subprocess.Popen(argv, cwd=ROOT, stderr=stderr))
    try:

        async def check() -> None:
            for port in ports:
                await wait_serving(f"http://127.0.0.1:{port}")
                await scrape_and_complete(f"http://127.0.0.1:{port}")

        asyncio.run(check())
    finally:
        for process in processes:
            process.terminate()
        assert [process.wait(10) for process in processes] == [0, 0]
    for port, log in zip(ports, logs, strict=True):
        records = json_log(log)  # every line is one JSON object
        (started,) = [r for r in records if r["message"].startswith("simulated engine")]
        assert f"events tcp://127.0.0.1:{port - EVENTS_PORT_OFFSET}," in started["message"], started  # loopback
        paths = [r["path"] for r in records if r["logger"] == "sim_engine.access"]
        assert "/v1/completions" in paths and "/metrics" not in paths and "/health" not in paths, paths


@pytest.mark.parametrize("clash", ["--port", "--events-endpoint", "--replay-endpoint"])
async def test_a_failed_start_closes_what_it_started_and_the_first_engine_serves_on(clash):
    """A second engine on the first one's port: StartupError, and no task or socket left behind."""
    events, replay = free_port(), free_port()
    first_settings = settings(events_endpoint=f"tcp://*:{events}", replay_endpoint=f"tcp://*:{replay}")
    async with running_engine(first_settings) as first:
        before = asyncio.all_tasks()
        spare = {
            "port": free_port(),
            "events_endpoint": f"tcp://*:{free_port()}",
            "replay_endpoint": f"tcp://*:{free_port()}",
        }
        taken = {
            "--port": {"port": int(first.url.rsplit(":", 1)[1])},
            "--events-endpoint": {"events_endpoint": f"tcp://*:{events}"},
            "--replay-endpoint": {"replay_endpoint": f"tcp://*:{replay}"},
        }[clash]
        with pytest.raises(StartupError, match=f"already in use; pass another {clash}"):
            async with running_engine(settings(**{**spare, **taken})):
                pytest.fail("an engine started on a port in use")
        assert asyncio.all_tasks() == before
        async with running_engine(settings(**spare)) as third:  # what the failed one bound was released
            status, _ = await post(third.url, {"prompt": "hello", "max_tokens": 1})
            assert status == 200
        status, _ = await post(first.url, {"prompt": "hello", "max_tokens": 1})
        assert status == 200


@pytest.mark.parametrize(
    ("port", "endpoint"),
    [
        (8000, "tcp://127.0.0.1:5557"),
        (8001, "tcp://127.0.0.1:5558"),
        (9100, "tcp://127.0.0.1:6657"),
        (0, "tcp://127.0.0.1:*"),
    ],
)
def test_the_default_event_endpoint_follows_the_http_address_and_port_and_is_bound(port, endpoint):
    default = SimEngineSettings(port=port)
    assert default.events_endpoint == endpoint and default.events_bind  # loopback: bound, not connected
    assert SimEngineSettings(port=port, host="0.0.0.0").events_endpoint == endpoint.replace("127.0.0.1", "*")
    assert SimEngineSettings(port=port, host="::1").events_endpoint == endpoint.replace("127.0.0.1", "[::1]")
    given = SimEngineSettings(port=port, events_endpoint="tcp://*:7000")
    assert given.events_endpoint == "tcp://*:7000" and not given.events_bind  # vLLM's rule
    assert SimEngineSettings(port=port, events_endpoint=None).events_endpoint is None
