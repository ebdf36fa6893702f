"""``kvroute epp``: a router replica that also answers Envoy's ext_proc on ``--grpc-port``.

The replica is the HTTP router's whole (:func:`router.main.running_router`: index, shared load,
learned cost, ``/metrics``, ``/health``, the dashboard on ``--port``), so EPP replicas and HTTP
routers share one index and one in-flight load. Beside it, one gRPC server: the
``envoy.service.ext_proc.v3.ExternalProcessor`` service (an :class:`~router.epp.exchange.Exchange`
per stream) and gRPC health, whose ``liveness`` is always serving and whose ``readiness`` and
ext_proc services serve while the replica has a view of the workers (the protocol's names).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvservice.lifecycle import listening, run_service, serve_until_signal
from kvservice.logs import configure_logging
from kvservice.options import fail_settings
from router.epp.exchange import Exchange
from router.epp.settings import EppSettings, settings_from_args
from router.main import RunningRouter, running_router
from router.state import RouterState

log = logging.getLogger("router.epp")
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("readiness", EXT_PROC_SERVICE, "")
HEALTH_PERIOD_S = 1.0
STOP_GRACE_S = 5.0  # streams in flight get this long to end at shutdown


class Picker(ext_proc_grpc.ExternalProcessorServicer):
    """The ext_proc service: one :class:`Exchange` per stream, closed however the stream ends."""

    def __init__(self, state: RouterState) -> None:
        self._state = state
        self.inflight = [0]  # exchanges holding a booking (the --max-inflight limit's count)

    async def Process(
        self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        exchange = Exchange(self._state, self.inflight)
        try:
            async for request in request_iterator:
                for response in await exchange.answer(request):
                    yield response
        finally:
            exchange.close()


@dataclass
class RunningEpp:
    router: RunningRouter
    grpc_port: int
    picker: Picker

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


@asynccontextmanager
async def running_epp(settings: EppSettings) -> AsyncIterator[RunningEpp]:
    """The replica and its gRPC server, until the block exits (tests, ``kvroute epp``). The gRPC
    port is bound first: a port in use is one line before anything else starts."""
    server = grpc.aio.server()
    try:
        port = _bind(server, f"{settings.grpc_host}:{settings.grpc_port}")
        async with running_router(settings.router) as router:
            picker = Picker(router.state)
            ext_proc_grpc.add_ExternalProcessorServicer_to_server(picker, server)
            checks = health.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(checks, server)
            checks.set("liveness", health_pb2.HealthCheckResponse.SERVING)
            await server.start()
            mirror = asyncio.create_task(_mirror_readiness(router.state, checks))
            try:
                yield RunningEpp(router, port, picker)
            finally:
                mirror.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await mirror
                await server.stop(STOP_GRACE_S)  # before the router: streams in flight close their bookings
    finally:
        await server.stop(None)


def _bind(server: grpc.aio.Server, address: str) -> int:
    with listening("the endpoint picker's gRPC", address, "--grpc-port (or --grpc-host)"):
        try:
            port = server.add_insecure_port(address)
        except RuntimeError:  # grpc says only that it failed to bind: the usual cause, said so
            port = 0
        if port == 0:
            raise OSError(errno.EADDRINUSE, "the address is already in use")
    return port


async def _mirror_readiness(state: RouterState, checks: health.HealthServicer) -> None:
    """Readiness and the ext_proc service serve while the replica sees the workers."""
    while True:
        ready = state.fleet.has_view
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in READY_SERVICES:
            checks.set(service, status)
        await asyncio.sleep(HEALTH_PERIOD_S)


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``kvroute epp``: settings (a mistake: one line, exit 2), logging, then serve until a signal."""
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        fail_settings(parser, exc, args)
    configure_logging(settings.router.log)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def ready(epp: RunningEpp) -> None:
        log.info(
            "endpoint picker %s: ext_proc and gRPC health on %s:%d, HTTP on %s",
            settings.router.replica_id,
            settings.grpc_host,
            epp.grpc_port,
            epp.router.url,
        )

    return run_service(parser.prog, lambda: serve_until_signal(running_epp(settings), ready))
