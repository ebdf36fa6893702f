"""router.settings: the limits, the pool and the retention from flags or KVROUTE_* variables."""

from __future__ import annotations

import pytest

from router.main import build_parser
from router.routing.pd import PdCosts, SplitMode, WholeOn
from router.settings import HttpServerKind, RouterSettings, UpstreamClientKind, settings_from_args
from router.workers import worker_settings


def _settings(argv: list[str], env: dict[str, str] | None = None) -> RouterSettings:
    return settings_from_args(build_parser().parse_args(argv), env or {})


def test_defaults():
    settings = _settings([])
    assert settings.max_body_bytes == 32 << 20 and settings.max_prompt_tokens == 1 << 20
    assert settings.redis_pool_size == 32 and settings.worker_retain_s == 30.0


def test_the_redis_budget_keeps_three_connections_from_decisions():
    assert _settings([]).lookup_slots == 29
    assert _settings(["--redis-pool-size", "4"]).lookup_slots == 1  # the least: one decision at a time


def test_variables_set_what_no_flag_does_and_flags_win():
    env = {
        "KVROUTE_MAX_BODY_BYTES": "2048",
        "KVROUTE_MAX_PROMPT_TOKENS": "500",
        "KVROUTE_REDIS_POOL_SIZE": "8",
        "KVROUTE_WORKER_RETAIN_S": "2.5",
    }
    settings = _settings([], env)
    assert (settings.max_body_bytes, settings.max_prompt_tokens, settings.redis_pool_size) == (2048, 500, 8)
    assert settings.worker_retain_s == 2.5
    flagged = _settings(["--max-prompt-tokens", "7", "--redis-pool-size", "4", "--worker-retain-s", "0"], env)
    assert (flagged.max_prompt_tokens, flagged.redis_pool_size, flagged.worker_retain_s) == (7, 4, 0)


def test_the_prefill_decode_settings_come_from_flags_else_variables():
    assert _settings([]).pd == PdCosts()
    env = {"KVROUTE_PD_SPLIT": "Always", "KVROUTE_PD_TRANSFER_MS": "2.5"}
    assert _settings([], env).pd == PdCosts(SplitMode.ALWAYS, 2.5)
    assert _settings(["--pd-split", "off", "--pd-hop-ms", "0"], env).pd == PdCosts(SplitMode.OFF, 2.5, 0.0)
    env = {"KVROUTE_PD_WHOLE_ON": "decode", "KVROUTE_PD_DECODE_WEIGHT": "1"}
    assert _settings([], env).pd == PdCosts(whole_on=WholeOn.DECODE, decode_weight=1.0)
    assert _settings(["--pd-whole-on", "any", "--pd-decode-weight", "0"], env).pd == PdCosts(decode_weight=0.0)


def test_the_http_server_comes_from_the_flag_else_the_variable():
    assert _settings([]).http_server is HttpServerKind.BUILTIN
    assert _settings([], {"KVROUTE_HTTP_SERVER": "AIOHTTP"}).http_server is HttpServerKind.AIOHTTP
    assert (
        _settings(["--http-server", "builtin"], {"KVROUTE_HTTP_SERVER": "aiohttp"}).http_server
        is HttpServerKind.BUILTIN
    )
    with pytest.raises(ValueError, match="--http-server must be one of builtin, aiohttp, got 'uvicorn'"):
        _settings(["--http-server", "uvicorn"])


def test_the_upstream_client_comes_from_the_flag_else_the_variable():
    assert _settings([]).upstream_client is UpstreamClientKind.BUILTIN
    assert _settings([], {"KVROUTE_UPSTREAM_CLIENT": "aiohttp"}).upstream_client is UpstreamClientKind.AIOHTTP
    flagged = _settings(["--upstream-client", "builtin"], {"KVROUTE_UPSTREAM_CLIENT": "aiohttp"})
    assert flagged.upstream_client is UpstreamClientKind.BUILTIN


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {"KVROUTE_MAX_PROMPT_TOKENS": "lots"}, "KVROUTE_MAX_PROMPT_TOKENS must be an integer, got 'lots'"),
        ([], {"KVROUTE_WORKER_RETAIN_S": "soon"}, "KVROUTE_WORKER_RETAIN_S must be a number, got 'soon'"),
        (["--max-prompt-tokens", "0"], {}, "--max-prompt-tokens must be at least 1"),
        (["--redis-pool-size", "3"], {}, "--redis-pool-size must be at least 4"),
        (["--worker-retain-s", "-1"], {}, "--worker-retain-s must be 0 or more"),
        ([], {"KVROUTE_MAX_BODY_BYTES": "100"}, "--max-body-bytes must be at least 1024"),
        (["--workers", "0"], {}, "--workers must be at least 1"),
        (["--workers", "2", "--port", "0"], {}, "--workers above 1 needs a fixed --port"),
        (
            [],
            {"KVROUTE_UPSTREAM_CLIENT": "curl"},
            "KVROUTE_UPSTREAM_CLIENT must be one of builtin, aiohttp, got 'curl'",
        ),
        ([], {"KVROUTE_HTTP_SERVER": "fast"}, "KVROUTE_HTTP_SERVER must be one of builtin, aiohttp, got 'fast'"),
        ([], {"KVROUTE_PD_SPLIT": "sometimes"}, "KVROUTE_PD_SPLIT must be one of auto, always, never, off"),
        (["--pd-transfer-ms", "-1"], {}, "--pd-transfer-ms and --pd-hop-ms must be >= 0"),
        ([], {"KVROUTE_PD_HOP_MS": "x"}, "KVROUTE_PD_HOP_MS must be a number, got 'x'"),
        ([], {"KVROUTE_PD_WHOLE_ON": "all"}, "KVROUTE_PD_WHOLE_ON must be one of any, decode, got 'all'"),
        (["--pd-decode-weight", "-0.5"], {}, "--pd-decode-weight must be >= 0"),
    ],
)
def test_bad_values_are_one_line_naming_the_setting(argv, env, message):
    with pytest.raises(ValueError) as error:
        _settings(argv, env)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_each_of_workers_processes_is_a_replica_of_its_own():
    settings = _settings(["--workers", "3", "--replica-id", "edge", "--port", "9000"], {})
    assert (settings.workers, settings.reuse_port) == (3, False)
    ones = [worker_settings(settings, n) for n in range(3)]
    assert [s.replica_id for s in ones] == ["edge-w0", "edge-w1", "edge-w2"]
    assert all(s.workers == 1 and s.reuse_port and s.port == 9000 for s in ones)
