"""Pure parts of the agent: settings from flags and environment, parsing the engine's /metrics."""

from __future__ import annotations

import argparse

import pytest

from kvindex.types import WorkerLoad
from tests.conftest import CAPTURES
from worker_agent.engine import parse_metrics, root_url
from worker_agent.settings import add_arguments, settings_from_args

CAPTURE = CAPTURES / "run1_metrics.txt"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_win_over_environment_and_defaults_fill_the_rest():
    env = {"KVROUTE_ENGINE_URL": "http://env:8000", "KVROUTE_EVENTS": "tcp://env:5557", "KVROUTE_DP_RANK": "2",
           "KVROUTE_REDIS_URL": "redis://:secret@redis:6379/0"}  # fmt: skip
    settings = settings_from_args(parse(["--engine-url", "http://flag:8000/v1", "--block-size", "32"]), env)
    assert settings.engine_url == "http://flag:8000/v1" and settings.engine_root == "http://flag:8000"
    assert settings.events == "tcp://env:5557" and settings.dp_rank == 2 and settings.block_size == 32
    assert settings.resolved_worker_id == "http://flag:8000#2"
    assert "secret" not in repr(settings)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {}, "missing required setting(s): --engine-url, --events"),
        (["--engine-url", "flag:8000", "--events", "tcp://e:1"], {}, "must be an http(s) URL"),
        (["--engine-url", "http://e:8000", "--events", "e:5557"], {}, "must be a ZMQ endpoint"),
        (["--engine-url", "http://e:8000", "--events", "tcp://e:1", "--block-size", "0"], {}, "--block-size"),
        (["--engine-url", "http://e:8000", "--events", "tcp://e:1"], {"KVROUTE_DP_RANK": "x"}, "KVROUTE_DP_RANK"),
        (["--engine-url", "http://e:8000", "--events", "tcp://e:1", "--ttl-ms", "500"], {}, "two heartbeat"),
    ],
)
def test_bad_settings_are_rejected_with_a_message_naming_them(argv, env, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        settings_from_args(parse(argv), env)


def test_the_real_servers_metrics_page_gives_load_and_block_size():
    metrics = parse_metrics(CAPTURE.read_text(), dp_rank=0)
    assert metrics.block_size == 32
    assert metrics.load == WorkerLoad(0, 0, 0.0)


def test_data_parallel_ranks_are_told_apart_by_the_engine_label():
    text = "\n".join(
        f'vllm:{name}{{engine="{rank}",model_name="m"}} {value}'
        for rank, values in ((0, (1, 2, 0.5)), (1, (7, 8, 0.25)))
        for name, value in zip(
            ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"), values, strict=True
        )
    )
    assert parse_metrics(text, dp_rank=1).load == WorkerLoad(7, 8, 0.25)
    assert parse_metrics(text, dp_rank=None).load == WorkerLoad(8, 10, 0.75)
    assert parse_metrics("nothing_here 1\n", dp_rank=0).load is None


def test_root_url_strips_the_openai_suffix():
    assert root_url("http://h:8000/v1/") == "http://h:8000"
    assert root_url("http://h:8000") == "http://h:8000"
