"""Secrets: the Redis password and API keys from files, and never printed, query strings included.

Unit checks of the redaction, then real password-protected redis-servers and a real router process
whose logs and error replies are searched for the password.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings, redact_url
from kvroute.cli import main as kvroute_main
from kvroute.devstack.embedded_redis import RedisServer, free_port
from router.main import build_parser as router_parser
from router.settings import settings_from_args as router_settings
from tests.support import ROOT, wait_until

SECRET = "s3cr3t-Pa55"


@pytest.fixture(scope="module")
def locked_redis() -> RedisServer:
    server = RedisServer(extra_args=("--requirepass", SECRET)).start()
    yield server
    server.stop()


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "redis-password"
    path.write_text(SECRET + "\n")
    return path


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"redis://:{SECRET}@10.0.0.9:6379/0", "redis://:***@10.0.0.9:6379/0"),
        (f"rediss://router:{SECRET}@redis.internal/0", "rediss://router:***@redis.internal/0"),
        (f"redis://10.0.0.9:6379/0?password={SECRET}", "redis://10.0.0.9:6379/0?password=***"),
        (f"redis://h/0?db=1&PassWord={SECRET}&x=1", "redis://h/0?db=1&PassWord=***&x=1"),
        (f"unix:///run/redis.sock?password={SECRET}", "unix:///run/redis.sock?password=***"),
        (f"redis://:{SECRET}@h:notaport/0", "redis://:***@h:notaport/0"),
        (f"redis://:{SECRET}@[::1/0", "<unparsable Redis URL>"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ],
)
def test_redact_url_hides_every_password(url, shown):
    assert redact_url(url) == shown


def test_settings_never_show_the_password(password_file):
    for settings in (
        RedisSettings(url=f"redis://10.0.0.9/0?password={SECRET}"),
        RedisSettings(url=f"redis://u:{SECRET}@10.0.0.9/0"),
        RedisSettings.from_env({"KVROUTE_REDIS_PASSWORD_FILE": str(password_file)}, url="redis://u@10.0.0.9/0"),
    ):
        assert SECRET not in repr(settings) and SECRET not in str(settings)
    with pytest.raises(ValueError) as refused:
        RedisSettings(url=f"redis://10.0.0.9/0?password={SECRET}&", prefix="{bad}")
    assert SECRET not in str(refused.value)
    with pytest.raises(ValueError, match=r"^Redis URL must start with .*password=\*\*\*"):
        RedisSettings(url=f"http://10.0.0.9/0?password={SECRET}")


def test_a_password_in_the_url_and_in_a_file_is_refused(password_file):
    with pytest.raises(ValueError, match="in the URL or in --redis-password-file, not both"):
        RedisSettings.from_env({}, url=f"redis://:{SECRET}@h/0", password_file=str(password_file))


@pytest.mark.parametrize("content", [None, ""])
def test_a_missing_or_empty_password_file_is_one_line(tmp_path, content, capsys):
    path = tmp_path / "nothing"
    if content is not None:
        path.write_text(content)
    assert kvroute_main(["index", "workers", "--redis-password-file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    reason = "No such file or directory" if content is None else "is empty"
    assert err.startswith(f"kvroute index workers: error: cannot read --redis-password-file '{path}'") or (
        err == f"kvroute index workers: error: --redis-password-file '{path}' is empty"
    )
    assert reason in err and "\n" not in err


async def test_the_password_file_logs_a_client_in(locked_redis, password_file, unique_name):
    settings = RedisSettings.from_env({"KVROUTE_REDIS_PASSWORD_FILE": str(password_file)}, url=locked_redis.url)
    client = settings.client()
    try:
        assert await client.ping()
        assert await RedisIndex(client).workers(unique_name) == []
    finally:
        await client.aclose()
    unauthenticated = RedisSettings(url=locked_redis.url).client()
    try:
        with pytest.raises(Exception, match=r"NOAUTH|Authentication required|authenticated"):
            await unauthenticated.ping()
    finally:
        await unauthenticated.aclose()


def test_the_cli_takes_the_password_file_and_a_wrong_password_is_not_echoed(locked_redis, password_file, capsys):
    assert (
        kvroute_main(["index", "stats", "--redis-url", locked_redis.url, "--redis-password-file", str(password_file)])
        == 0
    )
    capsys.readouterr()
    wrong = f"redis://127.0.0.1:{locked_redis.port}/0?password={SECRET}-wrong"
    assert kvroute_main(["index", "workers", "--redis-url", wrong]) == 2
    err = capsys.readouterr().err
    assert SECRET not in err and "password=***" in err and len(err.strip().splitlines()) == 1


def test_api_keys_from_a_file(tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text("key-one\n\n  key-two  \n")
    settings = router_settings(router_parser().parse_args(["--api-key-file", str(keys), "--api-key", "k3"]), env={})
    assert settings.api_keys == {"key-one", "key-two", "k3"}
    assert "key-one" not in repr(settings)
    from_env = router_settings(router_parser().parse_args([]), env={"KVROUTE_API_KEY_FILE": str(keys)})
    assert from_env.api_keys == {"key-one", "key-two"}
    with pytest.raises(ValueError, match=r"^cannot read --api-key-file"):
        router_settings(router_parser().parse_args(["--api-key-file", str(tmp_path / "none")]), env={})


async def _router_logs(redis_url: str, *extra: str) -> str:
    """Start a real router, wait until it answers /health (and, when Redis lets it in, /ready),
    stop it and return everything it wrote."""
    port = free_port()
    command = [sys.executable, "-m", "router", "--redis-url", redis_url, "--port", str(port), "--log-level", "DEBUG"]
    process = subprocess.Popen(  # noqa: ASYNC220 - started once, read after it stops
        [*command, *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        async with aiohttp.ClientSession() as session:

            async def ready() -> bool:
                try:
                    async with session.get(f"http://127.0.0.1:{port}/ready") as response:
                        body = await response.text()
                        assert SECRET not in body
                        return True
                except aiohttp.ClientError:
                    return False

            await wait_until(ready, 30)
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "x"}) as r:
                assert SECRET not in await r.text()
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    return output.decode()


async def test_a_router_never_logs_the_password(locked_redis, password_file):
    in_query = await _router_logs(f"redis://127.0.0.1:{locked_redis.port}/0?password={SECRET}")
    assert "password=***" in in_query and SECRET not in in_query
    from_file = await _router_logs(locked_redis.url, "--redis-password-file", str(password_file))
    assert "redis://127.0.0.1" in from_file and SECRET not in from_file
    wrong = await _router_logs(f"redis://:{SECRET}x@127.0.0.1:{locked_redis.port}/0")
    assert "redis://:***@127.0.0.1" in wrong and SECRET not in wrong
