"""``kvroute bench epp``: how fast one ``kvroute epp`` process picks (issue 57's targets).

A private Redis lists four workers of the tiny model (addresses nothing answers: the picker only
names them); one ``kvroute epp`` process runs beside it. A client plays Envoy over ext_proc:
* **round latency**: one request at a time, the request's headers and its buffered body sent and
  the pick read back (the round the gateway waits for before it proxies), p50 and p99, for 8k-token
  token-id prompts and for 2k-token text prompts (the same bodies as ``kvroute bench router``);
  each stream is then reset, which releases the booking as a client that went away does;
* **picks/s**: ``--concurrency`` streams at once for ``--seconds``, short token-id prompts;
* the picker process's CPU per pick (``cpu_us``, from /proc).
Compare the round's p50 with the router's added p50 of ``kvroute bench router`` in the same sitting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvindex.types import WorkerInfo
from kvroute.bench.common import percentile
from kvroute.bench.router import MODEL, cpu_s, token_bodies
from kvroute.devstack.embedded_redis import RedisServer, free_port
from kvroute.devstack.processes import start_logged, stop_processes
from sim_engine.settings import TINY_MODEL_DIR

HEADERS = base_pb2.HeaderMap(
    headers=[
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
        base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
    ]
)
CONFIG = ext_proc.ProtocolConfiguration(
    request_body_mode=ProcessingMode.BUFFERED, response_body_mode=ProcessingMode.BUFFERED
)


async def _round(stub: ext_proc_grpc.ExternalProcessorStub, body: bytes) -> float:
    """One request's pick (headers, then the buffered body), in seconds; the stream then reset."""
    started = time.perf_counter()
    call = stub.Process()
    await call.write(
        ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders(headers=HEADERS), protocol_config=CONFIG)
    )
    await call.read()
    await call.write(ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=body, end_of_stream=True)))
    answer = await call.read()
    seconds = time.perf_counter() - started
    if answer is grpc.aio.EOF or answer.HasField("immediate_response"):
        raise RuntimeError(f"the picker did not pick: {answer}")
    call.cancel()
    return seconds


async def _ready(target: str, process: subprocess.Popen[bytes], log: str) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"kvroute epp exited with {process.returncode}; its log: {log}")
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"kvroute epp was not ready within 60 s; its log: {log}")


async def _latency(stub: Any, kind: str, count: int, pid: int) -> dict[str, float]:
    for body in token_bodies(kind, 20, seed=1):  # warm-up: tokenizer, memos, learned cost
        await _round(stub, body)
    bodies = token_bodies(kind, count)
    cpu = cpu_s([pid])
    samples = [await _round(stub, body) * 1000 for body in bodies]
    cpu = cpu_s([pid]) - cpu
    return {
        "p50_ms": round(statistics.median(samples), 3),
        "p99_ms": round(percentile(samples, 0.99), 3),
        "cpu_us": round(cpu * 1e6 / count),
    }


async def _throughput(stub: Any, args: argparse.Namespace, pid: int) -> dict[str, float]:
    bodies = [
        json.dumps({"model": MODEL, "prompt": [i % 1900 + 10] * 128, "max_tokens": 1}).encode() for i in range(256)
    ]
    done = 0
    deadline = time.perf_counter() + args.seconds

    async def stream(offset: int) -> None:
        nonlocal done
        position = offset
        while time.perf_counter() < deadline:
            await _round(stub, bodies[position % len(bodies)])
            position += args.concurrency
            done += 1

    cpu = cpu_s([pid])
    started = time.perf_counter()
    await asyncio.gather(*(stream(i) for i in range(args.concurrency)))
    elapsed = time.perf_counter() - started
    return {"picks_per_s": round(done / elapsed), "cpu_us": round((cpu_s([pid]) - cpu) * 1e6 / max(done, 1))}


async def run_benchmark(redis_url: str, args: argparse.Namespace) -> dict[str, Any]:
    client = RedisSettings(url=redis_url).client()
    index = RedisIndex(client)
    for i in range(4):
        await index.register(WorkerInfo(f"w{i}", MODEL, f"http://127.0.0.1:{free_port()}", 16), ttl_ms=3_600_000)
    await client.aclose()
    port = free_port()
    command = [sys.executable, "-m", "kvroute", "epp", "--redis-url", redis_url, "--port", "0"]
    command += ["--grpc-host", "127.0.0.1", "--grpc-port", str(port), "--log-level", "WARNING"]
    command += ["--tokenizer", f"{MODEL}={TINY_MODEL_DIR}"]
    process, log = start_logged(command, "epp")
    results: dict[str, Any] = {}
    try:
        target = f"127.0.0.1:{port}"
        await _ready(target, process, log)
        async with grpc.aio.insecure_channel(target) as channel:
            stub = ext_proc_grpc.ExternalProcessorStub(channel)
            for kind in args.kinds:
                results[kind] = await _latency(stub, kind, args.requests, process.pid)
                print(f"{kind}: {results[kind]}", flush=True)
            results["picks"] = await _throughput(stub, args, process.pid)
            print(f"picks: {results['picks']}", flush=True)
    finally:
        stop_processes([process])
    return results


def run_from_args(args: argparse.Namespace) -> int:
    with RedisServer().start() as server:
        results = asyncio.run(run_benchmark(server.url, args))
    print(json.dumps(results, indent=2))
    return 0
