"""Pure parts of the agent: settings from flags and environment, parsing the engine's /metrics."""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvindex.types import WorkerLoad
from tests.conftest import CAPTURES
from worker_agent.engine import ComputedTokens, EngineMetrics, parse_metrics, parse_models, root_url
from worker_agent.engine_kinds import SGLANG, SGLANG_METRICS, kind_of_listing
from worker_agent.events import EventsWatch
from worker_agent.inbox import Inbox
from worker_agent.metrics import AgentCollector, AgentCounters, Gauges, new_registry
from worker_agent.restarts import RestartEvidence
from worker_agent.settings import add_arguments, settings_from_args
from worker_agent.translate import TranslateCounters

CAPTURE = CAPTURES / "run1_metrics.txt"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_win_over_environment_and_defaults_fill_the_rest():
    env = {
        "KVROUTE_ENGINE_URL": "http://env:8000",
        "KVROUTE_EVENTS": "tcp://env:5557",
        "KVROUTE_DP_RANK": "2",
        "KVROUTE_REDIS_URL": "redis://:secret@redis:6379/0",
        "KVROUTE_EVENTS_WARN_AFTER": "12.5",
    }
    settings = settings_from_args(parse(["--engine-url", "http://flag:8000/v1", "--block-size", "32"]), env)
    assert settings.engine_url == "http://flag:8000/v1" and settings.engine_root == "http://flag:8000"
    assert settings.events == "tcp://env:5557" and settings.dp_rank == 2 and settings.block_size == 32
    assert settings.resolved_worker_id == "http://flag:8000#2"
    assert settings.events_warn_after_s == 12.5
    assert "secret" not in repr(settings)
    assert settings_from_args(parse(["--events-warn-after", "0"]), env).events_warn_after_s == 0
    assert settings_from_args(parse([]), {**env, "KVROUTE_EVENTS_WARN_AFTER": ""}).events_warn_after_s == 30
    wildcard = {**env, "KVROUTE_EVENTS": "tcp://*:5557"}
    assert settings_from_args(parse(["--events-bind"]), wildcard).events_bind is True
    assert settings_from_args(parse([]), {**wildcard, "KVROUTE_EVENTS_BIND": "true"}).events_bind is True
    assert settings_from_args(parse([]), env).events_bind is False


def test_the_role_comes_from_the_flag_else_the_engines_kv_role():
    base = ["--engine-url", "http://e:8000", "--events", "tcp://e:1"]
    assert settings_from_args(parse(base), {}).role == "both"
    assert settings_from_args(parse([*base, "--role", "decode"]), {}).role == "decode"
    assert settings_from_args(parse(base), {"KVROUTE_ROLE": "prefill"}).role == "prefill"
    producer = ["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}']
    assert settings_from_args(parse([*base, *producer]), {}).role == "prefill"
    consumer = {"KVROUTE_KV_TRANSFER_CONFIG": '{"kv_role": "kv_consumer"}'}
    assert settings_from_args(parse(base), consumer).role == "decode"
    # NIXL fleets run every engine as kv_both and name the split to the proxy: --role says it
    both = ["--kv-transfer-config", '{"kv_role": "kv_both"}']
    assert settings_from_args(parse([*base, *both]), {}).role == "both"
    assert settings_from_args(parse([*base, *both, "--role", "prefill"]), {}).role == "prefill"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {}, "missing required setting(s): --engine-url (or KVROUTE_ENGINE_URL)"),
        (["--engine-url", "http://e:8000"], {}, "missing required setting(s): --events (or KVROUTE_EVENTS)"),
        (["--engine-url", "flag:8000", "--events", "tcp://e:1"], {}, "must be an http(s) URL"),
        (["--engine-url", "http://e:8000", "--events", "e:5557"], {}, "must be a ZMQ endpoint"),
        (["--engine-url", "http://e:8000", "--events", "tcp://e:1", "--block-size", "0"], {}, "--block-size"),
        (["--engine-url", "http://e:8000", "--events", "tcp://e:1"], {"KVROUTE_DP_RANK": "x"}, "KVROUTE_DP_RANK"),
        (["--engine-url", "http://e:8000", "--events", "tcp://e:1", "--ttl-ms", "500"], {}, "two heartbeat"),
        (["--engine-url", "http://e:8000", "--events", "tcp://e:1", "--replay", "tcp://*:2"], {}, "engine's host"),
        (["--engine-url", "http://e:8000", "--events", "tcp://e:1", "--events-warn-after", "-1"], {}, ">= 0"),
        (["--engine-url", "http://e:8000", "--events", "tcp://*:1"], {}, "pass --events-bind"),
        (["--engine-url", "http://e:8000", "--events", "tcp://0.0.0.0:1"], {}, "pass --events-bind"),
        (["--engine-url", "http://e:8000", "--events", "tcp://e:1", "--events-bind"], {}, "needs a wildcard"),
        (
            ["--engine-url", "http://e:8000", "--events", "tcp://*:1"],
            {"KVROUTE_EVENTS_BIND": "maybe"},
            "KVROUTE_EVENTS_BIND must be 1 or 0",
        ),
        (["--engine-url", "http://e:8000", "--events", "tcp://e:1", "--replay-deadline", "0"], {}, "--replay-deadline"),
        (
            ["--engine-url", "http://e:8000", "--events", "tcp://e:1", "--max-queued-bytes", "0"],
            {},
            "--max-queued-bytes",
        ),
        (
            ["--engine-url", "http://e:8000", "--events", "tcp://e:1"],
            {"KVROUTE_EVENTS_WARN_AFTER": "soon"},
            "KVROUTE_EVENTS_WARN_AFTER must be a number",
        ),
        (["--engine-url", "http://e:8000", "--events", "tcp://e:1", "--role", "boss"], {}, "--role must be one of"),
        (
            ["--engine-url", "http://e:8000", "--events", "tcp://e:1", "--kv-transfer-config", "{kv_role"],
            {},
            "--kv-transfer-config must be JSON",
        ),
        (
            ["--engine-url", "http://e:8000", "--events", "tcp://e:1"],
            {"KVROUTE_KV_TRANSFER_CONFIG": '{"kv_role": "kv_boss"}'},
            "KVROUTE_KV_TRANSFER_CONFIG: kv_role must be one of kv_producer, kv_consumer, kv_both, got 'kv_boss'",
        ),
    ],
)
def test_bad_settings_are_rejected_with_a_message_naming_them(argv, env, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        settings_from_args(parse(argv), env)


def test_the_real_servers_metrics_page_gives_load_block_size_and_work():
    metrics = parse_metrics(CAPTURE.read_text(), dp_rank=0)
    assert metrics.block_size == 32
    assert metrics.load == WorkerLoad(0, 0, 0.0, capacity_blocks=32768)  # num_gpu_blocks of cache_config_info
    assert metrics.work == 826 + 8  # vllm:prompt_tokens_total + vllm:request_success_total
    assert parse_metrics("nothing_here 1\n").work is None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watch_for(seconds: float = 5.0) -> tuple[EventsWatch, Clock]:
    clock = Clock()
    return EventsWatch("tcp://engine:5557", "kv", seconds, clock), clock


def test_an_engine_that_keeps_working_unanswered_makes_the_watch_warn_once(caplog):
    watch, clock = watch_for()
    work = 1000.0
    for _ in range(30):  # an idle engine (counters flat) never does
        watch.engine_up(work)
        clock.now += 0.25
        assert not watch.check()
    for _ in range(20):  # 4.75 s of work with no message: not yet
        work += 50
        watch.engine_up(work)
        assert not watch.check()
        clock.now += 0.25
    watch.engine_up(work + 50)
    with caplog.at_level(logging.WARNING, logger="worker_agent.events"):
        assert watch.check() and watch.check()
    (record,) = caplog.records
    assert "tcp://engine:5557" in record.getMessage() and "--topic 'kv'" in record.getMessage()
    assert record.fields == {"endpoint": "tcp://engine:5557", "topic": "kv", "seconds": 5.0}
    watch.message()
    assert not watch.silent and watch.seconds_since_message() == 0


def test_one_burst_of_work_or_a_message_that_overtook_the_counters_is_no_reason_to_warn():
    watch, clock = watch_for()
    watch.engine_up(10.0)
    watch.message()  # the events of a request arrive before the agent sees the counters move
    clock.now += 0.25
    watch.engine_up(60.0)
    for _ in range(100):  # then the engine idles
        clock.now += 0.25
        watch.engine_up(60.0)
        assert not watch.check()


def test_without_work_counters_silence_while_the_engine_is_up_counts():
    watch, clock = watch_for()
    for _ in range(20):
        watch.engine_up(None)
        assert not watch.check()
        clock.now += 0.25
    watch.engine_up(None)
    assert watch.check()
    watch.engine_down()  # a new engine process: start over
    assert not watch.silent and not watch.check()


def test_a_busy_engine_whose_prompts_fill_no_new_block_is_no_reason_to_warn(caplog):
    """Fully cached or short prompts publish nothing: 100 requests of 10 computed tokens each (a
    block is 16) is silence a healthy engine keeps; a request that computed a block's worth is
    not."""
    watch, clock = watch_for()
    prompt = finished = 0.0
    for _ in range(100):  # 25 s of requests: 160 prompt tokens, 150 of them cached, 0 generated
        prompt, finished = prompt + 160, finished + 1
        watch.engine_up(prompt + finished, ComputedTokens(prompt - 150 * finished, finished, 1, 16))
        clock.now += 0.25
        assert not watch.check()
    with caplog.at_level(logging.WARNING, logger="worker_agent.events"):
        for _ in range(30):  # now each request computes 40 tokens: some block was filled
            prompt, finished = prompt + 160, finished + 1
            computed = prompt - 150 * finished + 30 * (finished - 100)
            watch.engine_up(prompt + finished, ComputedTokens(computed, finished, 1, 16))
            clock.now += 0.25
            if watch.check():
                break
    assert watch.silent and len(caplog.records) == 1


def test_metrics_say_what_the_engine_computed_when_they_count_it():
    page = "\n".join(
        [
            "vllm:num_requests_running 2",
            "vllm:num_requests_waiting 1",
            "vllm:kv_cache_usage_perc 0.5",
            "vllm:prompt_tokens_total 1000",
            "vllm:prompt_tokens_cached_total 800",
            "vllm:generation_tokens_total 50",
            "vllm:request_success_total 7",
        ]
    )
    metrics = parse_metrics(page)
    assert metrics.computed(16) == ComputedTokens(250, 7, 3, 16) and metrics.work == 1007
    assert metrics.computed(None) is None  # the block size unknown
    assert parse_metrics(page.replace("generation_tokens", "other")).computed(16) is None


def test_a_zero_delay_turns_the_watch_off():
    watch, clock = watch_for(0)
    for _ in range(100):
        watch.engine_up(None)
        clock.now += 1
        assert not watch.check()


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


def load_page(running: str, waiting: str, usage: str, extra: str = "") -> str:
    labels = '{engine="0",model_name="m"}'
    return (
        f"vllm:num_requests_running{labels} {running}\nvllm:num_requests_waiting{labels} {waiting}\n"
        f"vllm:kv_cache_usage_perc{labels} {usage}\n{extra}"
    )


@pytest.mark.parametrize(
    ("running", "waiting", "usage", "metric", "reason"),
    [
        ("+Inf", "0", "0.5", "vllm:num_requests_running", "+Inf"),
        ("1", "NaN", "0.5", "vllm:num_requests_waiting", "NaN"),
        ("1", "2", "NaN", "vllm:kv_cache_usage_perc", "NaN"),
        ("1", "2", "-Inf", "vllm:kv_cache_usage_perc", "-Inf"),
        ("1", "2", "lots", "vllm:kv_cache_usage_perc", "not a number"),
        ("-3", "2", "0.5", "vllm:num_requests_running", "negative"),
        ("1e300", "2", "0.5", "vllm:num_requests_running", "out of range"),
    ],
)
def test_a_bad_load_value_is_reported_and_never_becomes_a_load(running, waiting, usage, metric, reason):
    metrics = parse_metrics(load_page(running, waiting, usage), dp_rank=0)
    assert metrics.load is None
    (bad,) = metrics.bad
    assert bad.metric == metric and reason in bad.reason and "\n" not in bad.reason


def test_a_bad_value_spoils_only_its_own_metric_and_other_ranks_do_not_count():
    extra = (
        'vllm:prompt_tokens_total{engine="0"} NaN\nvllm:request_success_total{engine="0"} 7\n'
        'vllm:num_requests_running{engine="1"} +Inf\nprocess_start_time_seconds 1.7e+09\n'
        "some_other_metric{broken 3\n"  # not one the agent reads: not its business
    )
    metrics = parse_metrics(load_page("1", "2", "0.25", extra), dp_rank=0)
    assert metrics.load == WorkerLoad(1, 2, 0.25)
    assert metrics.counters == {"vllm:request_success_total": 7} and metrics.work == 7
    assert metrics.start_time == 1.7e9
    assert [b.metric for b in metrics.bad] == ["vllm:prompt_tokens_total"]


def test_a_page_of_garbage_gives_nothing_and_does_not_raise():
    for text in ("\x00\xff" * 100, "vllm:num_requests_running", 'vllm:kv_cache_usage_perc{engine="0" 0.5\n'):
        metrics = parse_metrics(text, dp_rank=0)
        assert metrics.load is None and metrics.work is None and metrics.start_time is None


def reading(start_time: float | None = None, **counters: float) -> EngineMetrics:
    names = {"prompts": "vllm:prompt_tokens_total", "successes": "vllm:request_success_total"}
    return EngineMetrics(None, None, {names[k]: v for k, v in counters.items()}, start_time)


def test_a_new_start_time_is_a_restart_and_the_same_one_is_not_whatever_the_counters_do():
    evidence = RestartEvidence()
    assert evidence.observe(reading(1000.0, prompts=50)) is None  # the first reading: nothing to compare
    assert evidence.observe(reading(1000.0, prompts=10)) is None  # same process: the start time wins
    assert evidence.observe(reading(None, prompts=60)) is None  # a reading without it (a bad value)
    why = evidence.observe(reading(2000.0, prompts=0))
    assert why == "process_start_time_seconds changed from 1000.000 to 2000.000"
    assert evidence.observe(reading(2000.0, prompts=5)) is None


def test_without_a_start_time_a_counter_going_back_is_a_restart():
    evidence = RestartEvidence()
    assert evidence.observe(reading(prompts=100, successes=4)) is None
    assert evidence.observe(reading(prompts=100)) is None  # a counter missing from one page is no evidence
    assert evidence.observe(reading(prompts=120, successes=4)) is None
    assert evidence.observe(reading(prompts=3, successes=0)) == "vllm:prompt_tokens_total went back from 120 to 3"
    assert evidence.observe(reading(prompts=4, successes=1)) is None  # counted from the new process on
    assert evidence.observe(reading()) is None and evidence.observe(reading(prompts=4, successes=1)) is None


async def test_the_inbox_holds_what_its_bounds_allow_and_counts_the_rest():
    counters = AgentCounters()
    inbox = Inbox(max_messages=3, max_bytes=100, counters=counters)
    assert inbox.put([b"kv", b"a" * 40]) and inbox.put([b"kv", b"b" * 40])
    assert not inbox.put([b"kv", b"c" * 40])  # 126 bytes would be over 100
    assert inbox.put([b"kv", b"d"]) and not inbox.put([b"kv"])  # the fourth message is one too many
    assert counters.dropped_messages == 2 and len(inbox) == 3 and inbox.bytes == 87
    taken = await inbox.take(2)
    assert [m.frames[1] for m in taken] == [b"a" * 40, b"b" * 40] and inbox.bytes == 3
    assert inbox.put([b"kv", b"e" * 40]) and len(inbox) == 2


def test_every_counter_and_gauge_is_on_the_metrics_page_with_its_help():
    counters = AgentCounters(engine_metric_errors=2, dropped_messages=3, replays_timed_out=1, heartbeats=9)
    gauges = Gauges(0, 0, 0, True, True, 7, engine_start_time_seconds=1.5e9, queued_messages=4, queued_bytes=99)
    registry, _ = new_registry()
    registry.register(AgentCollector(counters, TranslateCounters, lambda: gauges))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    counter_names = {f.name for f in fields(AgentCounters)} - {"reasserts"}
    for name in counter_names:  # a counter without a help text would silently be left out
        assert families[f"kvroute_agent_{name}"].type == "counter" and families[f"kvroute_agent_{name}"].documentation
    for name in (f.name for f in fields(Gauges)):
        assert families[f"kvroute_agent_{name}"].type == "gauge"
    values = {s.name: s.value for f in families.values() for s in f.samples}
    assert values["kvroute_agent_engine_metric_errors_total"] == 2 and values["kvroute_agent_heartbeats_total"] == 9
    assert values["kvroute_agent_dropped_messages_total"] == 3 and values["kvroute_agent_replays_timed_out_total"] == 1
    assert values["kvroute_agent_queued_bytes"] == 99 and values["kvroute_agent_engine_start_time_seconds"] == 1.5e9


def test_a_model_listing_separates_base_models_from_their_lora_adapters():
    from worker_agent.engine import ServedModels, parse_models

    listing = {
        "object": "list",
        "data": [
            {"id": "tiny", "object": "model", "root": "/models/tiny", "parent": None},
            {"id": "sql-lora", "object": "model", "root": "/adapters/sql", "parent": "tiny"},
            {"id": "chat-lora", "object": "model", "root": "/adapters/chat", "parent": "tiny"},
            {"id": "other-base-lora", "object": "model", "parent": "big"},
            {"id": "two\nlines", "parent": "tiny"},  # not one line: the index could not keep it
            {"id": 7},
            "garbage",
            {"object": "model"},
        ],
    }
    served = parse_models(listing)
    assert served.bases == ("tiny",)
    assert served.adapters_of("tiny") == ("chat-lora", "sql-lora") and served.adapters_of("big") == ("other-base-lora",)
    assert parse_models({"data": "nope"}) == ServedModels() and parse_models(["x"]) == ServedModels()


def test_a_base_models_context_length_is_read_from_its_model_card():
    """vLLM's model card has max_model_len (an adapter's is null): the agent registers it."""
    from worker_agent.engine import parse_models

    listing = {
        "data": [
            {"id": "tiny", "parent": None, "max_model_len": 2048},
            {"id": "sql-lora", "parent": "tiny", "max_model_len": None},
            {"id": "odd", "max_model_len": True},
            {"id": "neg", "max_model_len": -4},
        ]
    }
    assert parse_models(listing).max_model_len == {"tiny": 2048}


def test_the_engine_kind_comes_from_the_flag_or_its_variable_and_must_be_one_known():
    base = ["--engine-url", "http://e:8000", "--events", "tcp://e:1"]
    assert settings_from_args(parse(base), {}).engine_kind is None  # the engine's listing says, else vllm
    assert settings_from_args(parse(base), {"KVROUTE_ENGINE_KIND": "sglang"}).engine_kind == "sglang"
    assert (
        settings_from_args(parse([*base, "--engine-kind", "vllm"]), {"KVROUTE_ENGINE_KIND": "sglang"}).engine_kind
        == "vllm"
    )
    with pytest.raises(ValueError, match="--engine-kind must be one of vllm, sglang, trtllm, got 'tgi'"):
        settings_from_args(parse([*base, "--engine-kind", "tgi"]), {})


def test_a_listing_names_its_engine_in_owned_by():
    assert kind_of_listing({"data": [{"id": "m", "owned_by": "sglang"}]}) == SGLANG
    assert kind_of_listing({"data": [{"id": "m", "owned_by": "vllm"}]}) == "vllm"
    assert kind_of_listing({"data": [{"id": "m", "owned_by": "openai"}]}) is None
    assert kind_of_listing({"data": "nothing"}) is None and kind_of_listing([]) is None
    assert parse_models({"data": [{"id": "m", "owned_by": "sglang"}]}).engine_kind == SGLANG


SGLANG_PAGE = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 3.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 9.0
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 2.0
sglang:token_usage{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.25
sglang:max_total_num_tokens{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 32768.0
sglang:page_size{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 1.0
sglang:prompt_tokens_total{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 1000.0
sglang:cached_tokens_total{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 600.0
sglang:generation_tokens_total{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 50.0
sglang:num_requests_total{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 7.0
vllm:num_requests_running{engine="0"} 100.0
"""


def test_an_sglang_page_gives_load_capacity_in_index_blocks_and_work_by_sglang_names():
    metrics = parse_metrics(SGLANG_PAGE, dp_rank=0, names=SGLANG_METRICS, block_size=16)
    assert metrics.load == WorkerLoad(3, 2, 0.25, 32768 // 16)  # rank 1's series and vLLM's names do not count
    assert metrics.block_size is None  # a page is not the index's block
    assert metrics.work == 1007.0
    assert metrics.computed(16) == ComputedTokens(1000 - 600 + 50, 7.0, 5, 16)
    assert parse_metrics(SGLANG_PAGE, dp_rank=0).load is None  # read as vLLM's page, it has no load


def test_a_tensorrt_llm_engine_is_polled_over_http_and_needs_no_zmq_endpoint():
    polled = settings_from_args(parse(["--engine-url", "http://e:8000/v1", "--engine-kind", "trtllm"]), {})
    assert polled.events is None and polled.events_url == "http://e:8000/kv_cache_events"
    other = ["--engine-url", "http://e:8000", "--engine-kind", "trtllm", "--events", "http://proxy:9/kv_cache_events"]
    assert settings_from_args(parse(other), {}).events_url == "http://proxy:9/kv_cache_events"
    with pytest.raises(ValueError, match="--events must be the engine's POST /kv_cache_events URL"):
        settings_from_args(
            parse(["--engine-url", "http://e:8000", "--engine-kind", "trtllm", "--events", "tcp://e:1"]), {}
        )
    with pytest.raises(ValueError, match="--events must be a ZMQ endpoint"):
        settings_from_args(parse(["--engine-url", "http://e:8000", "--events", "http://e:8000/kv_cache_events"]), {})
    with pytest.raises(ValueError, match="missing required setting"):
        settings_from_args(parse(["--engine-url", "http://e:8000"]), {})


def test_an_unknown_engine_kind_is_named_before_what_it_would_require():
    with pytest.raises(ValueError, match="--engine-kind must be one of vllm, sglang, trtllm, got 'bogus'"):
        settings_from_args(parse(["--engine-url", "http://e:8000", "--engine-kind", "bogus"]), {})
