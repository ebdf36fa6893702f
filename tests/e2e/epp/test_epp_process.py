"""``kvroute epp`` as a process: one-line mistakes, and a picker that serves gRPC health and
ext_proc from its own process (what a Kubernetes probe and Envoy reach)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.devstack.embedded_redis import RedisServer, free_port
from tests.e2e.test_cli_errors import kvroute, one_line
from tests.support import ROOT, wait_until


def test_a_bad_grpc_port_is_one_line_naming_it():
    line = one_line(kvroute("epp", "--grpc-port", "many"), 2)
    assert "--grpc-port must be an integer, got 'many'" in line
    line = one_line(kvroute("epp", env={"KVROUTE_GRPC_PORT": "70000"}), 2)
    assert "KVROUTE_GRPC_PORT must be within 0..65535" in line


def test_a_grpc_port_in_use_is_one_line(redis_server: RedisServer):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = kvroute(
            "epp", "--redis-url", redis_server.url, "--port", "0", "--grpc-host", "127.0.0.1", "--grpc-port", str(port)
        )
    assert f"cannot listen on 127.0.0.1:{port} for the endpoint picker's gRPC" in one_line(result, 2)


def _start(command: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def test_the_picker_process_serves_grpc_health(redis_server: RedisServer):
    port = free_port()
    command = [sys.executable, "-m", "kvroute", "epp", "--redis-url", redis_server.url, "--port", "0"]
    command += ["--grpc-host", "127.0.0.1", "--grpc-port", str(port)]
    process = _start(command)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def ready() -> bool:
                assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
                except grpc.aio.AioRpcError:
                    return False
                return reply.status == health_pb2.HealthCheckResponse.SERVING

            await wait_until(ready, 30)
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 10)
    assert process.returncode == 0
