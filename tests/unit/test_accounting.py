"""Decision-quality accounting (router/routing/accounting.py): the three-way split of lost prefix tokens,
the rolling window and the shared-prefix table, as pure functions over given numbers and times."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvroute.bench.lost_split import degraded_share, lost_from_exposition, lost_shares, shares_text
from router.routing.accounting import Bucket, RollingWindow, SharedPrefixes, split, summary

BS = 16


def test_a_load_trade_off_is_the_better_match_given_up():
    # 100 tokens: 6 full blocks, 96 cacheable. Worker a holds 4 blocks, the chosen b holds 1.
    s = split(100, BS, 6, [4, 1, 0], chosen_blocks=1, reported=16)
    assert (s.cacheable, s.best_match, s.chosen_match) == (96, 64, 16)
    assert s.lost() == {"load_tradeoff": 48, "stale_index": 0, "cold": 32}
    assert s.log_fields() == {
        "best_match_tokens": 64,
        "lost_load_tokens": 48,
        "lost_stale_tokens": 0,
        "cold_tokens": 32,
    }


def test_a_stale_index_is_a_prediction_the_engine_did_not_have():
    s = split(100, BS, 6, [3, 3], chosen_blocks=3, reported=16)
    assert s.lost() == {"load_tradeoff": 0, "stale_index": 32, "cold": 48} and s.unpredicted == 0


def test_without_a_report_stale_is_unknown_not_zero():
    s = split(100, BS, 6, [2], chosen_blocks=2)
    assert s.reported is None and s.lost_stale is None and s.unpredicted is None
    assert s.log_fields()["lost_stale_tokens"] is None and s.lost()["stale_index"] == 0


def test_cold_is_counted_in_whole_blocks_and_never_the_last_token():
    # 32 tokens = 2 full blocks, but vLLM never serves the last prompt token from cache: 16 cacheable.
    s = split(32, BS, 2, [2], chosen_blocks=2, reported=16)
    assert (s.cacheable, s.best_match, s.cold, s.lost_stale) == (16, 16, 0, 0)
    short = split(10, BS, 0, [0], chosen_blocks=0, reported=0)  # shorter than a block: nothing cacheable
    assert (short.cacheable, short.cold, short.lost_load) == (0, 0, 0)


def test_the_engine_having_more_than_predicted_is_unpredicted_not_negative_stale():
    s = split(100, BS, 6, [1], chosen_blocks=1, reported=48)
    assert s.lost_stale == 0 and s.unpredicted == 32


@given(
    prompt=st.integers(0, 3000),
    matched=st.lists(st.integers(0, 250), min_size=1, max_size=8),
    chosen=st.integers(0, 7),
    reported=st.none() | st.integers(0, 3000),
)
def test_the_split_adds_up_to_what_was_not_served(prompt, matched, chosen, reported):
    blocks = prompt // BS
    if reported is not None:  # an engine reports at most what the rounding allows
        reported = min(reported, max(0, (prompt - 1) // BS * BS))
    s = split(prompt, BS, blocks, matched, matched[chosen % len(matched)], reported)
    assert 0 <= s.chosen_match <= s.best_match <= s.cacheable < max(prompt, 1)
    assert min(s.lost_load, s.cold) >= 0
    assert s.cacheable - s.chosen_match == s.cold + s.lost_load
    if reported is not None:
        assert s.cacheable - reported == s.cold + s.lost_load + s.lost_stale - s.unpredicted


def test_the_window_keeps_the_last_buckets_and_rates():
    window = RollingWindow(bucket_s=10, buckets=3)
    window.note_decision(5.0, degraded=False)
    window.note_split(5.0, split(100, BS, 6, [4, 1], chosen_blocks=1, reported=16))
    window.note_decision(25.0, degraded=True)
    series = window.series(25.0)
    assert [ago for ago, _ in series] == [25.0, 15.0, 5.0]
    assert [b.decisions for _, b in series] == [1, 0, 1] and series[2][1].degraded == 1
    total, seconds = window.total(25.0)
    assert (total.decisions, total.accounted, total.cacheable, seconds) == (2, 1, 96, 25.0)
    rates = summary(total, seconds)
    assert rates["hit_rate"] == round(16 / 100, 4) and rates["predicted_hit_rate"] == 0.16
    assert rates["lost_share"] == {"load_tradeoff": 0.5, "stale_index": 0.0, "cold": round(32 / 96, 4)}
    assert rates["decisions_per_s"] == 0.08
    window.note_decision(45.0, degraded=False)  # the first bucket (0-10 s) has left the window
    assert window.total(45.0)[0].decisions == 2 and window.total(45.0, last_s=10)[0].decisions == 1


def test_an_empty_window_has_no_rates_rather_than_zero():
    rates = summary(Bucket(), 0.0)
    assert rates["hit_rate"] is None and rates["lost_share"]["cold"] is None and rates["decisions_per_s"] is None


def test_shared_prefixes_rank_by_hits_and_stay_bounded():
    table = SharedPrefixes(limit=3)
    for _ in range(3):
        table.note("tiny", 0xABC, 256, holders=2, now=1.0)
    table.note("tiny", -5, 64, holders=1, now=2.0)  # hashes are signed 64-bit: shown as unsigned hex
    top = table.top(2, now=3.0)
    assert [(p["hits"], p["tokens"], p["holders"]) for p in top] == [(3, 256, 2), (1, 64, 1)]
    assert top[1]["hash"] == "fffffffffffffffb"[:12] and top[0]["last_seen_s_ago"] == 2.0
    for n in range(5):
        table.note("tiny", n, 16, holders=1, now=4.0)
    assert len(table) == 3 and all(p["tokens"] == 16 for p in table.top(5, now=4.0))


def test_a_routers_metrics_page_gives_its_split_and_a_peers_none():
    page = (
        'kvroute_router_lost_prefix_tokens_total{reason="load_tradeoff"} 30.0\n'
        'kvroute_router_lost_prefix_tokens_total{reason="cold"} 50.0\n'
        'kvroute_router_cacheable_prompt_tokens_total{model="a"} 100.0\n'
        'kvroute_router_cacheable_prompt_tokens_total{model="b"} 100.0\n'
    )
    lost = lost_from_exposition(page)
    assert lost == {
        "load_tradeoff": 30.0,
        "stale_index": 0.0,
        "cold": 50.0,
        "cacheable": 200.0,
        "decisions": 0.0,
        "degraded_decisions": 0.0,
    }
    assert lost_shares(lost) == {"load_tradeoff": 0.15, "stale_index": 0.0, "cold": 0.25}
    assert degraded_share(lost) is None  # no decision on the page
    assert shares_text(lost_shares(lost)) == "15.0/0.0/25.0%"
    assert lost_from_exposition("sglang_requests_total 3.0\n") is None and shares_text(None) == "n/a"


def test_a_routers_degraded_decisions_are_a_share_of_all_its_decisions():
    page = (
        'kvroute_router_cacheable_prompt_tokens_total{model="a"} 100.0\n'
        'kvroute_router_decisions_total{model="a",worker="w0",policy="kv"} 150.0\n'
        'kvroute_router_decisions_total{model="a",worker="w1",policy="kv"} 40.0\n'
        'kvroute_router_decisions_total{model="a",worker="w1",policy="degraded"} 10.0\n'
    )
    lost = lost_from_exposition(page)
    assert degraded_share(lost) == 0.05
    assert shares_text(lost_shares(lost), degraded_share(lost)) == "0.0/0.0/0.0%, 5.0% degraded"
    assert shares_text(lost_shares(lost), 0.0) == "0.0/0.0/0.0%"


def test_regret_is_another_worker_predicted_to_serve_more_than_the_engine_did():
    # the chosen worker was predicted 1 block and served it; another held 4: a load trade-off regretted
    traded = split(100, BS, 6, [4, 1], chosen_blocks=1, reported=16, other_blocks=[4])
    assert (traded.best_other, traded.regret) == (64, 48)
    # the best worker chosen, and it served what it promised: no regret
    assert split(100, BS, 6, [4, 1], chosen_blocks=4, reported=64, other_blocks=[1]).regret == 0
    # the best chosen but its index was stale, and another held 2 blocks: regretted by what it lacked
    assert split(100, BS, 6, [4, 2], chosen_blocks=4, reported=0, other_blocks=[2]).regret == 32
    # unknown without the engine's report
    assert split(100, BS, 6, [4, 1], chosen_blocks=1, other_blocks=[4]).regret is None


def test_the_window_gives_the_share_of_regretted_requests():
    window = RollingWindow(bucket_s=10, buckets=3)
    window.note_split(1.0, split(100, BS, 6, [4, 1], chosen_blocks=1, reported=16, other_blocks=[4]))
    window.note_split(2.0, split(100, BS, 6, [4, 1], chosen_blocks=4, reported=64, other_blocks=[1]))
    window.note_split(3.0, split(100, BS, 6, [4], chosen_blocks=4, other_blocks=[]))  # not reported
    total, seconds = window.total(3.0)
    assert (total.regretted, total.regret_tokens, total.reported_requests) == (1, 48, 2)
    assert summary(total, seconds)["regret_share"] == 0.5
    assert summary(Bucket(), 0.0)["regret_share"] is None
