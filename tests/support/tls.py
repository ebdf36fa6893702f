"""A self-signed CA with server and client certificates (openssl CLI), and a TLS-only Redis."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from kvroute.devstack.embedded_redis import default_server_binary, free_port


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def make_certificates(directory: Path) -> Certificates:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all signed by the CA."""
    ca, ca_key = directory / "ca.crt", directory / "ca.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "2",
             "-subj", "/CN=kvroute test CA")  # fmt: skip
    extensions = directory / "san.cnf"
    extensions.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    issued = {}
    for name in ("server", "client"):
        key, request, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.crt"
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", request, "-subj", f"/CN={name}")
        _openssl("x509", "-req", "-in", request, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
                 "-days", "2", "-extfile", extensions)  # fmt: skip
        issued[name] = (cert, key)
    return Certificates(ca, *issued["server"], *issued["client"])


class TlsRedis:
    """redis-server with TLS only (--port 0), requiring client certificates signed by the CA."""

    def __init__(self, certs: Certificates, workdir: Path) -> None:
        self.certs = certs
        self.port = free_port()
        args = [default_server_binary(), "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--tls-cert-file", str(certs.server_cert), "--tls-key-file", str(certs.server_key)]
        args += ["--tls-ca-cert-file", str(certs.ca), "--tls-auth-clients", "yes"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(workdir)]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_until_up()

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def _wait_until_up(self, within_s: float = 10.0) -> None:
        deadline = time.monotonic() + within_s
        client = redis.Redis.from_url(
            self.url,
            ssl_ca_certs=str(self.certs.ca),
            ssl_certfile=str(self.certs.client_cert),
            ssl_keyfile=str(self.certs.client_key),
            socket_connect_timeout=0.5,
        )
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        raise
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
