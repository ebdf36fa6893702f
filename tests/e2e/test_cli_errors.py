"""What `kvroute index`, `kvroute bench` and `kvroute demo` tell a user who got a setting wrong:
one line on stderr that names the problem (passwords redacted) and what to do, exit status 2, never
a traceback; and, for an index view that finds nothing, a hint naming the server and prefix read.
Real processes against real private servers (tests/conftest.py), nothing mocked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvroute.cli.index import WORKER_COLUMNS
from kvroute.devstack.embedded_redis import RedisServer, free_port
from tests.support import ROOT

BAD_SCHEME = "localhost:6391"
PASSWORD = "hunter2"
HINT = "(is this the right --redis-url / --prefix?)"

# Every command that takes --redis-url, with what else it needs to get that far.
REDIS_COMMANDS = [
    ["index", "workers"],
    ["index", "stats"],
    ["index", "lookup", "--model", "m", "--tokens", "1,2"],
    ["index", "gc", "--model", "m"],
    ["bench", "index"],
    ["bench", "agent"],
    ["demo"],
]


def kvroute(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")} | (env or {})
    command = [sys.executable, "-m", "kvroute", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, env=environment)


def one_line(result: subprocess.CompletedProcess[str], status: int) -> str:
    """The only line on stderr, after checking the exit status and that there is no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert result.returncode == status, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def password_server() -> Iterator[RedisServer]:
    """A private server that wants a password."""
    server = RedisServer(extra_args=("--requirepass", PASSWORD)).start()
    yield server
    server.stop()


@pytest.mark.parametrize("command", REDIS_COMMANDS, ids=" ".join)
def test_a_url_without_a_scheme_is_one_line_with_status_2(command):
    line = one_line(kvroute(*command, "--redis-url", BAD_SCHEME), 2)
    assert line == (
        f"kvroute {' '.join(command[:2] if command[0] != 'demo' else command[:1])}: error: "
        "Redis URL must start with redis://, rediss://, unix://, redis+cluster:// or rediss+cluster://, "
        f"got '{BAD_SCHEME}'"
    )


@pytest.mark.parametrize("command", REDIS_COMMANDS, ids=" ".join)
def test_an_unreachable_redis_is_named_without_its_password(command):
    url = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"  # nothing listens there
    line = one_line(kvroute(*command, "--redis-url", url), 2)
    assert f"error: cannot use Redis at {url.replace(PASSWORD, '***')}: " in line
    assert "Connection refused" in line and "check --redis-url" in line and PASSWORD not in line


def test_the_url_from_the_environment_is_checked_like_the_flag():
    line = one_line(kvroute("index", "stats", env={"KVROUTE_REDIS_URL": BAD_SCHEME}), 2)
    assert line.endswith(f"got '{BAD_SCHEME}'")


def test_a_wrong_password_is_one_line_without_the_password(password_server):
    url = f"redis://:wrong-{PASSWORD}@127.0.0.1:{password_server.port}/0"
    line = one_line(kvroute("index", "workers", "--redis-url", url), 2)
    assert f"cannot use Redis at redis://:***@127.0.0.1:{password_server.port}/0" in line
    assert PASSWORD not in line


def test_a_url_redis_cannot_parse_is_one_line():
    line = one_line(kvroute("index", "workers", "--redis-url", "redis://127.0.0.1:port/0"), 2)
    assert line.startswith("kvroute index workers: error: cannot use Redis URL redis://127.0.0.1:port/0: ")


@pytest.mark.parametrize("json_flag", [True, False], ids=["json", "table"])
def test_an_empty_index_says_where_it_looked(redis_server, unique_name, json_flag):
    """stdout keeps its shape (valid JSON, or the table's header); the hint is on stderr."""
    flags = ["--redis-url", redis_server.url, "--prefix", unique_name] + (["--json"] if json_flag else [])
    result = kvroute("index", "workers", *flags)
    hint = one_line(result, 0)
    assert hint == f"no workers found under prefix '{unique_name}' on {redis_server.url} {HINT}"
    if json_flag:
        assert json.loads(result.stdout) == []
    else:
        assert result.stdout.split() == WORKER_COLUMNS  # the header alone


def test_every_redis_view_hints_when_it_finds_nothing(redis_server, unique_name):
    common = ["--redis-url", redis_server.url, "--prefix", unique_name, "--json"]
    where = f"under prefix '{unique_name}' on {redis_server.url} {HINT}"
    stats = kvroute("index", "stats", *common)
    assert one_line(stats, 0) == f"no workers found {where}"
    assert json.loads(stats.stdout)["models"] == []
    for view in (["workers", "--model", "m1"], ["stats", "--model", "m1"], ["gc", "--model", "m1"]):
        result = kvroute("index", *view, *common)
        assert one_line(result, 0) == f"no workers of model 'm1' found {where}", view
        json.loads(result.stdout)
    lookup = kvroute("index", "lookup", *common, "--model", "m1", "--tokens", "1,2,3", "--block-size", "2")
    assert one_line(lookup, 0) == f"no workers of model 'm1' found {where}"
    assert json.loads(lookup.stdout)["workers"] == []


def test_the_hint_redacts_the_password(password_server, unique_name):
    url = f"redis://:{PASSWORD}@127.0.0.1:{password_server.port}/0"
    result = kvroute("index", "workers", "--redis-url", url, "--prefix", unique_name)
    hint = one_line(result, 0)
    assert (
        hint
        == f"no workers found under prefix '{unique_name}' on redis://:***@127.0.0.1:{password_server.port}/0 {HINT}"
    )


def test_a_lookup_of_an_unknown_model_says_what_to_do(redis_server, unique_name):
    common = ["--redis-url", redis_server.url, "--prefix", unique_name]
    line = one_line(kvroute("index", "lookup", *common, "--model", "m1", "--tokens", "1,2"), 2)
    assert line == (
        f"kvroute index lookup: error: model 'm1' has no registered workers; pass --block-size "
        f"(looked under prefix '{unique_name}' on {redis_server.url}: is this the right --redis-url / --prefix?)"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give a TRACE file or --synthetic KIND (one of them)"),
        (["missing.jsonl"], "cannot read the trace missing.jsonl: No such file or directory"),
        (["--synthetic", "multi-turn", "--cache-fraction", "2"], "0 < --cache-fraction <= 1 are required"),
        (["--synthetic", "multi-turn", "--peer", "sglang", "--router-url", "http://x"], "--peer needs"),
        (["--synthetic", "multi-turn", "--peer", "sglang,oracle"], "--peer takes some of sglang,greedy_oracle"),
        (["--synthetic", "multi-turn", "--router-url", "localhost:8080"], "must list http:// or https:// URLs"),
        (["--synthetic", "multi-turn", "--repeats", "2", "--router-url", "http://x"], "--repeats needs"),
        (["--synthetic", "multi-turn", "--probe", "--router-url", "http://x"], "--probe needs the self-started"),
        (
            ["--synthetic", "multi-turn", "--router-url", f"http://127.0.0.1:{free_port()}"],
            "cannot reach the router at http://127.0.0.1:",
        ),
    ],
)
def test_bench_replay_settings_are_one_line(args, message):
    line = one_line(kvroute("bench", "replay", *args), 2)
    assert line.startswith("kvroute bench replay: error: ") and message in line


def test_bench_replay_names_the_malformed_row(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}\n{"timestamp": 5}\n')
    line = one_line(kvroute("bench", "replay", str(trace)), 2)
    assert f"{trace}:2: not a Mooncake trace row" in line
