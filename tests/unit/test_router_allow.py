"""router.routing.allow: which worker URLs --worker-allow admits; router.settings: the hardening flags."""

from __future__ import annotations

import re

import pytest

from router.main import build_parser
from router.routing.allow import WorkerAllowList
from router.settings import RouterSettings, settings_from_args


@pytest.mark.parametrize(
    ("url", "admitted"),
    [
        ("http://10.1.2.3:8000", True),
        ("https://[fd00::5]:8000", True),
        ("http://engine-1:8000", True),
        ("http://a.vllm.svc:8000", True),
        ("http://11.0.0.1:8000", False),
        ("http://engine-2:8000", False),
        ("http://evilvllm.svc:8000", False),  # a domain matches at a dot only
        ("ftp://10.0.0.1/", False),
        ("http://user:pw@10.0.0.1/", False),
        ("http://10.0.0.1:notaport/", False),
    ],
)
def test_the_allow_list_admits_networks_names_and_domains(url, admitted):
    allow = WorkerAllowList(["10.0.0.0/8", "fd00::/8", "engine-1", ".vllm.svc"])
    assert allow.permits(url) is admitted


def test_no_list_admits_any_plain_http_url():
    assert WorkerAllowList().open and WorkerAllowList().permits("http://203.0.113.9:1")
    assert not WorkerAllowList().permits("file:///etc/passwd")


def test_a_malformed_entry_is_an_error():
    with pytest.raises(ValueError, match=re.escape("--worker-allow '10.0.0.0/99'")):
        RouterSettings(worker_allow=("10.0.0.0/99",))


def _settings(argv: list[str], env: dict[str, str] | None = None) -> RouterSettings:
    return settings_from_args(build_parser().parse_args(argv), env or {})


def test_hardening_defaults_flags_and_variables():
    d = _settings([])
    assert (d.header_timeout_s, d.body_timeout_s, d.max_inflight) == (60.0, 60.0, 1024)
    assert (d.upstream_connections, d.upstream_connections_per_worker) == (1024, 256)
    assert not d.enable_debug and d.routing_headers and d.worker_allow == ()
    assert not _settings(["--api-key", "k"]).routing_headers  # tenants: hidden unless asked for
    assert _settings(["--api-key", "k", "--expose-routing-headers"]).routing_headers
    env = {"KVROUTE_MAX_INFLIGHT": "8", "KVROUTE_ENABLE_DEBUG": "true", "KVROUTE_WORKER_ALLOW": "10.0.0.0/8, .svc"}
    s = _settings(["--body-timeout-s", "5", "--no-expose-routing-headers"], env)
    assert (s.max_inflight, s.body_timeout_s, s.enable_debug, s.routing_headers) == (8, 5.0, True, False)
    assert s.worker_allow == ("10.0.0.0/8", ".svc")


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {"KVROUTE_ENABLE_DEBUG": "maybe"}, "KVROUTE_ENABLE_DEBUG must be 1 or 0"),
        (["--max-inflight", "0"], {}, "--max-inflight must be at least 1"),
        (["--body-timeout-s", "0"], {}, "--body-timeout-s must be positive"),
    ],
)
def test_bad_hardening_settings_are_one_line_errors(argv, env, message):
    with pytest.raises(ValueError, match=message):
        _settings(argv, env)
