"""TLS to Redis: the --redis-tls-* flags (and KVROUTE_REDIS_TLS_*) reach every client, against a
real TLS-only redis-server whose CA, server and client certificates are made here."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvindex.keys import KeySchema
from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvindex.types import StoredRun, WorkerInfo
from kvroute.cli import main as kvroute_main
from tests.support.tls import Certificates, TlsRedis, make_certificates


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make the test's CA and certificates")
    return make_certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_redis(certs: Certificates, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    server = TlsRedis(certs, tmp_path_factory.mktemp("tls-redis"))
    yield server
    server.stop()


def tls_flags(certs: Certificates) -> list[str]:
    return [
        "--redis-tls-ca",
        str(certs.ca),
        "--redis-tls-cert",
        str(certs.client_cert),
        "--redis-tls-key",
        str(certs.client_key),
    ]


async def test_a_client_with_the_ca_and_its_certificate_registers_stores_and_matches(tls_redis, certs, unique_name):
    settings = RedisSettings(
        url=tls_redis.url,
        prefix=unique_name,
        tls_ca=str(certs.ca),
        tls_cert=str(certs.client_cert),
        tls_key=str(certs.client_key),
    )
    client = settings.client()
    try:
        index = RedisIndex(client, KeySchema(settings.prefix))
        handle = await index.register(WorkerInfo("w0", "tiny", "http://127.0.0.1:9", 4))
        await handle.store([StoredRun(None, (11, 12, 13))])
        assert await index.match("tiny", [11, 12, 99]) == {"w0": 2}
    finally:
        await client.aclose()


def test_the_cli_reaches_a_tls_redis_with_the_flags_and_with_the_variables(tls_redis, certs, monkeypatch, capsys):
    assert kvroute_main(["index", "stats", "--json", "--redis-url", tls_redis.url, *tls_flags(certs)]) == 0
    capsys.readouterr()
    for name, path in (("CA", certs.ca), ("CERT", certs.client_cert), ("KEY", certs.client_key)):
        monkeypatch.setenv(f"KVROUTE_REDIS_TLS_{name}", str(path))
    assert kvroute_main(["index", "workers", "--json", "--redis-url", tls_redis.url]) == 0


def test_without_the_ca_the_server_certificate_is_refused_in_one_line(tls_redis, certs, capsys):
    flags = ["--redis-tls-cert", str(certs.client_cert), "--redis-tls-key", str(certs.client_key)]
    assert kvroute_main(["index", "workers", "--redis-url", tls_redis.url, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("kvroute index workers: error: cannot use Redis at rediss://127.0.0.1:")
    assert "certificate verify failed" in err


def test_without_a_client_certificate_the_server_refuses_the_client(tls_redis, certs, capsys):
    assert kvroute_main(["index", "workers", "--redis-url", tls_redis.url, "--redis-tls-ca", str(certs.ca)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("kvroute index workers: error: cannot use Redis at rediss://")


@pytest.mark.parametrize(
    ("url", "files", "message"),
    [
        ("redis://127.0.0.1:6379/0", {"tls_ca": "ca"}, r"TLS files need a rediss:// or rediss\+cluster:// URL"),
        ("rediss://127.0.0.1:6379/0", {"tls_cert": "cert"}, "--redis-tls-cert and --redis-tls-key go together"),
        (
            "rediss://127.0.0.1:6379/0",
            {"tls_ca": "/no/such/ca.crt"},
            "--redis-tls-ca '/no/such/ca.crt' is not a readable file",
        ),
    ],
)
def test_tls_settings_that_cannot_work_are_refused_at_start(url, files, message, certs):
    values = {name: (str(certs.ca) if value in ("ca", "cert") else value) for name, value in files.items()}
    with pytest.raises(ValueError, match=message):
        RedisSettings(url=url, **values)


def test_a_bad_tls_flag_is_one_line_from_the_cli(capsys, tmp_path: Path):
    assert (
        kvroute_main(["index", "workers", "--redis-url", "redis://127.0.0.1:6379/0", "--redis-tls-ca", str(tmp_path)])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "kvroute index workers: error: TLS files need a rediss:// or rediss+cluster:// URL, got 'redis://127.0.0.1:6379/0'"
    )
