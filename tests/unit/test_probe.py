"""The probes' split of a run's hit rate (kvroute.bench.probe): pure arithmetic over results."""

from __future__ import annotations

import pytest

from kvroute.bench.probe import engine_of, probe_split, split_text

ENGINES = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


def _result(prompt: int, cached: int, probe: list[int] | None, worker: str | None) -> dict:
    usage = {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}
    return {"failed": False, "usage": usage, "probe": probe, "worker": worker}


def test_the_engine_of_a_reply_is_found_by_worker_id_or_url():
    assert engine_of("http://127.0.0.1:8002#0", ENGINES) == 1
    assert engine_of("http://127.0.0.1:8001", ENGINES) == 0
    assert engine_of("http://127.0.0.1:8001/", ENGINES) == 0
    assert engine_of("http://127.0.0.1:9999#0", ENGINES) is None
    assert engine_of(None, ENGINES) is None


def test_a_run_splits_into_the_best_held_what_the_choice_gave_up_and_what_was_evicted():
    results = [
        # engine 1 held 64 tokens, the router chose engine 0 (32): 32 given up; 16 more evicted there
        _result(100, 16, [32, 64], "http://127.0.0.1:8001#0"),
        # the best was chosen and all of it was there when scheduled
        _result(100, 48, [0, 48], "http://127.0.0.1:8002#0"),
        # a prompt ahead computed 16 tokens more before it was scheduled: a negative schedule loss
        _result(200, 16, [0, 0], "http://127.0.0.1:8002#0"),
        {"failed": True},
    ]
    split = probe_split(results, ENGINES)
    assert split is not None
    assert split["best"] == pytest.approx((64 + 48 + 0) / 400)
    assert split["choice_loss"] == pytest.approx(32 / 400)
    assert split["schedule_loss"] == pytest.approx((16 + 0 - 16) / 400)
    assert split["hit_rate"] == pytest.approx(80 / 400)
    assert split["best"] - split["choice_loss"] - split["schedule_loss"] == pytest.approx(split["hit_rate"])
    assert split["choices_lost"] == 1 and split["known"] == 1.0
    assert split_text(split) == "28.0% - 8.0% - 0.0%"


def test_replies_from_an_unknown_engine_count_in_the_best_only():
    results = [_result(100, 10, [40, 20], None), _result(100, 20, [0, 20], "http://127.0.0.1:8002")]
    split = probe_split(results, ENGINES)
    assert split is not None and split["best"] == pytest.approx(0.3) and split["known"] == 0.5
    assert split["choice_loss"] == 0.0 and split["schedule_loss"] == 0.0


def test_without_probes_there_is_no_split():
    assert probe_split([_result(100, 10, None, None)], ENGINES) is None
    assert probe_split([], ENGINES) is None
    assert split_text(None) == "-"
