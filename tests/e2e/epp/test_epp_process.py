"""``kvroute epp`` as a process: one-line mistakes, and a picker that serves gRPC health and
ext_proc from its own process (what a Kubernetes probe and Envoy reach)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import grpc
import yaml
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


async def _until_serving(process: subprocess.Popen[bytes], port: int, service: str) -> None:
    """Until the picker process's gRPC health says ``service`` is serving (failing if it exits)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        async def serving() -> bool:
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
            except grpc.aio.AioRpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        await wait_until(serving, 30)


def _start(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def test_the_picker_process_serves_grpc_health(redis_server: RedisServer):
    port = free_port()
    command = [sys.executable, "-m", "kvroute", "epp", "--redis-url", redis_server.url, "--port", "0"]
    command += ["--grpc-host", "127.0.0.1", "--grpc-port", str(port)]
    process = _start(command)
    try:
        await _until_serving(process, port, "readiness")
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 10)
    assert process.returncode == 0


def _manifest_container(name: str) -> dict:
    for document in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / f"{name}.yaml").read_text()):
        if document and document["kind"] == "Deployment":
            return document["spec"]["template"]["spec"]["containers"][0]
    raise AssertionError(f"no Deployment in deploy/kubernetes/{name}.yaml")


def _as_in_the_manifest(name: str, redis_url: str, tmp_path: Path, ports: dict[str, int]) -> tuple[list[str], dict]:
    """The container's command, arguments and environment, pointed at a private Redis and free ports."""
    container = _manifest_container(name)
    words = [*container["command"], *container["args"]]
    for flag, port in ports.items():
        words[words.index(flag) + 1] = str(port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    for variable in container["env"]:
        value = variable.get("value", "a-pod")
        if variable["name"].endswith("_FILE"):
            (tmp_path / variable["name"]).write_text("a-secret\n")
            value = str(tmp_path / variable["name"])
        env[variable["name"]] = value
    env["KVROUTE_REDIS_URL"] = redis_url  # a private server without users: no password
    del env["KVROUTE_REDIS_PASSWORD_FILE"]
    return [sys.executable, "-m", *words], env


async def test_the_picker_starts_with_the_manifests_arguments(redis_server: RedisServer, tmp_path):
    grpc_port = free_port()
    command, env = _as_in_the_manifest("epp", redis_server.url, tmp_path, {"--grpc-port": grpc_port, "--port": 0})
    process = _start(command, env)
    try:
        await _until_serving(process, grpc_port, "liveness")
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 10)
    assert process.returncode == 0


async def test_the_router_starts_with_the_manifests_arguments(redis_server: RedisServer, tmp_path):
    port = free_port()
    command, env = _as_in_the_manifest("router", redis_server.url, tmp_path, {"--port": port})
    process = _start(command, env)
    try:
        async with aiohttp.ClientSession() as session:

            async def healthy() -> bool:
                assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
                try:
                    async with session.get(f"http://127.0.0.1:{port}/health") as reply:
                        return reply.status == 200
                except aiohttp.ClientError:
                    return False

            await wait_until(healthy, 30)
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json={}) as reply:
                assert reply.status == 401  # the API key file of the manifest is in force
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 10)
    assert process.returncode == 0
