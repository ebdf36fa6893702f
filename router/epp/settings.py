"""``kvroute epp``'s settings: every ``kvroute router`` setting, and where the gRPC server listens
(declared once, kvservice.declared; docs/kubernetes.md's table is ``kvroute settings epp``)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvservice.declared import add_declared, nested, of_type, read_declared, setting
from router.settings import SECTIONS, RouterSettings

GRPC = "endpoint picker"  # the --help section of its own settings


@dataclass(frozen=True)
class EppSettings:
    router: RouterSettings = nested(RouterSettings)
    grpc_host: str = setting(
        "0.0.0.0",
        flag="--grpc-host",
        group=GRPC,
        help="the address of the ext_proc and gRPC health server (the gateway's Envoy calls it from another pod)",
    )
    grpc_port: int = setting(
        9002,
        flag="--grpc-port",
        parse=of_type(int),
        group=GRPC,
        help="the port of the ext_proc and gRPC health server (GIE's default)",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.grpc_port <= 65535:
            raise ValueError(f"--grpc-port must be within 0..65535, got {self.grpc_port}")
        if self.router.workers != 1:
            raise ValueError("--workers is the HTTP router's: an endpoint picker runs one process per replica")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_declared(parser, EppSettings, {**SECTIONS, GRPC: "Envoy's external processing (docs/kubernetes.md)"})


def settings_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> EppSettings:
    return read_declared(EppSettings, args, os.environ if env is None else env)
