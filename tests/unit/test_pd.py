"""Prefill/decode fleets (router/routing/pd.py, router/upstream/split.py): whether a request is
split and over which workers, and the two legs' bodies and the reply's usage (pure parts)."""

from __future__ import annotations

import json
import random

import pytest

from kvindex.shared_load import InflightLoad
from kvindex.types import WorkerLoad
from router.routing.choice import choose
from router.routing.pd import Baseline, DecodeLegs, PdCosts, SplitMode, WholeOn, decode_load, plan
from router.routing.scoring import Candidate, ScoringWeights
from router.routing.ttft import CostModel
from router.upstream.split import PREFILL_PARAMS, SseRewriter, decode_leg_body, prefill_body, with_cached_tokens

BS = 16
MODEL = CostModel()


def ranked(*candidates: Candidate, prompt_blocks: int = 64):
    return choose(list(candidates), prompt_blocks, BS, ScoringWeights(), rng=random.Random(0), model=MODEL).ranked


def worker(name: str, matched: int = 0, running: int = 0, waiting: int = 0, usage: float = 0.1) -> Candidate:
    return Candidate(name, f"http://{name}", matched, engine=WorkerLoad(running, waiting, usage))


def pd_plan(scored, roles, prompt_tokens=64 * BS, mode=SplitMode.AUTO, baseline=None, **costs):
    """The plan with whole requests on decode workers only and stalls weighed in full, unless
    ``costs`` says otherwise: the split decision's terms one at a time."""
    costs = {"whole_on": WholeOn.DECODE, "decode_weight": 1.0} | costs
    return plan(scored, roles, prompt_tokens, BS, MODEL, PdCosts(mode, **costs), random.Random(1), baseline)


ROLES = {"p1": "prefill", "p2": "prefill", "d1": "decode", "d2": "decode"}


def test_a_fleet_of_complete_engines_is_never_split():
    scored = ranked(worker("a"), worker("b", running=30))
    found = pd_plan(scored, {"a": "both", "b": "both"}, mode=SplitMode.ALWAYS)
    assert not found.split and [s.candidate.worker_id for s in found.whole] == ["a", "b"]


def test_a_long_cold_prompt_beside_busy_decodes_is_split_to_the_least_loaded_decoder():
    scored = ranked(worker("p1"), worker("p2", waiting=4), worker("d1", running=40), worker("d2", running=10))
    found = pd_plan(scored, ROLES)
    assert found.split and found.split_s < found.whole_s
    assert found.prefill[0].candidate.worker_id == "p1"  # no queue
    assert [s.candidate.worker_id for s in found.decode] == ["d2", "d1"]
    assert {s.candidate.worker_id for s in found.whole} == {"d1", "d2"}  # prefill workers take no whole request


def test_a_prompt_the_decode_worker_holds_is_served_there_whole():
    """Little to prefill, little delay to the decodes there; split, the prefill worker would
    compute it all and send it over."""
    scored = ranked(worker("p1"), worker("d1", 63, running=8), worker("d2", running=8))
    found = pd_plan(scored, ROLES)
    assert not found.split and found.whole[0].candidate.worker_id == "d1"
    assert found.split_s is not None and found.whole_s < found.split_s
    assert pd_plan(scored, ROLES, mode=SplitMode.ALWAYS).split  # as the proxies of vLLM's examples
    assert not pd_plan(scored, ROLES, mode=SplitMode.NEVER).split
    off = pd_plan(scored, ROLES, mode=SplitMode.OFF)  # roles ignored: the prefill worker serves whole too
    assert not off.split and {s.candidate.worker_id for s in off.whole} == {"p1", "d1", "d2"}


def test_the_decision_moves_with_the_decodes_running():
    """The same cold prompt: whole on an idle decode worker, split beside many decodes."""
    idle = pd_plan(ranked(worker("p1"), worker("d1")), ROLES, prompt_tokens=64 * BS)
    busy = pd_plan(ranked(worker("p1"), worker("d1", running=50)), ROLES, prompt_tokens=64 * BS)
    assert not idle.split and busy.split


def test_decode_workers_rank_by_load_then_held_prefix_busy_last():
    full = worker("d1", 60, running=1, usage=0.99)  # its KV cache nearly full: busy
    scored = ranked(worker("p1"), full, worker("d2", 10, running=3), worker("d3", 0, running=3))
    found = pd_plan(scored, ROLES | {"d3": "decode"}, mode=SplitMode.ALWAYS)
    assert [s.candidate.worker_id for s in found.decode] == ["d2", "d3", "d1"]
    booked = Candidate("d4", "http://d4", inflight=InflightLoad(requests=9), engine=WorkerLoad(2, 0, 0.1))
    assert decode_load(ranked(booked)[0]) == 9  # requests booked by the routers and not yet reported


def test_a_complete_engine_decodes_split_requests_and_a_lone_prefill_worker_serves_none():
    found = pd_plan(ranked(worker("p1"), worker("b")), {"p1": "prefill", "b": "both"})
    assert [s.candidate.worker_id for s in found.decode] == ["b"] and not found.split  # idle: whole is faster
    assert pd_plan(ranked(worker("p1"), worker("b", running=50)), {"p1": "prefill", "b": "both"}).split
    alone = pd_plan(ranked(worker("p1")), {"p1": "prefill"})
    assert not alone.split and alone.whole == []


def test_pd_costs_refuse_negative_times():
    with pytest.raises(ValueError, match="--pd-transfer-ms"):
        PdCosts(transfer_ms_per_1k=-1)
    with pytest.raises(ValueError, match="--pd-decode-weight"):
        PdCosts(decode_weight=float("nan"))


def test_by_default_an_idle_prefill_worker_serves_a_prompt_whole_rather_than_split_it():
    """Complete engines (vLLM's NIXL ones are): split, the same prefill worker would compute the
    prompt and then pay the transfer, the hop and a decode step on top."""
    scored = ranked(worker("p1"), worker("d1", running=8), worker("d2", running=8))
    found = pd_plan(scored, ROLES, whole_on=WholeOn.ANY, decode_weight=0.5)
    assert not found.split and found.whole[0].candidate.worker_id == "p1"
    assert pd_plan(scored, ROLES).split  # prefill workers kept off whole requests: split beside the decodes


def test_whole_requests_go_where_they_stall_fewest_decodes():
    """Among the workers that serve it whole, a long cold prompt goes where its prefill stalls the
    fewest streams, though its TTFT is a little longer there; weighed at 0 (TTFT alone), it goes
    where its first token comes soonest."""
    quiet = worker("d2", running=1, waiting=1)  # a sequence queued: a slightly later first token
    scored = ranked(worker("p1", running=30), worker("d1", running=30), quiet)
    assert pd_plan(scored, ROLES, whole_on=WholeOn.ANY).whole[0].candidate.worker_id == "d2"
    assert pd_plan(scored, ROLES, whole_on=WholeOn.ANY, decode_weight=0.0).whole[0].candidate.worker_id != "d2"


def test_a_prefill_worker_that_serves_whole_requests_splits_none_that_it_could_serve():
    """Split, the request pays the same prefill on the prefill worker, the same stall on the streams
    decoding there, and the decode leg on top: serving it whole there is always cheaper. Kept off
    whole requests (whole on decode), its prefill stalls nothing and the busy decoders' cost splits."""
    busy = ranked(worker("p1", running=20), worker("d1", running=40), worker("d2", running=40))
    anywhere = pd_plan(busy, ROLES, whole_on=WholeOn.ANY, decode_weight=0.5)
    assert not anywhere.split and anywhere.whole[0].candidate.worker_id == "p1"
    assert anywhere.split_s is not None and anywhere.split_s > anywhere.whole_s
    assert pd_plan(busy, ROLES, decode_weight=0.5).split


def test_the_prefill_leg_asks_for_one_token_and_a_remote_decode():
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 50, "stream": True, "stream_options": {"x": 1}}
    leg = json.loads(prefill_body({**body, "min_tokens": 3, "max_completion_tokens": 50}))
    assert leg["kv_transfer_params"] == PREFILL_PARAMS and leg["kv_transfer_params"]["do_remote_decode"] is True
    assert (leg["stream"], leg["max_tokens"], leg["max_completion_tokens"]) == (False, 1, 1)
    assert "stream_options" not in leg and "min_tokens" not in leg
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e"}
    decoded = json.loads(decode_leg_body(body, params))
    assert decoded == {**body, "kv_transfer_params": params}  # the client's body otherwise as sent


def test_the_reply_says_the_prefill_sides_cached_tokens():
    reply = {"id": "x", "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}
    assert json.loads(with_cached_tokens(json.dumps(reply).encode(), 16))["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 16
    }
    bare = {"usage": {"prompt_tokens": 40, "prompt_tokens_details": None}}
    assert json.loads(with_cached_tokens(json.dumps(bare).encode(), 0))["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0
    }
    assert with_cached_tokens(b"not json", 3) == b"not json"
    assert with_cached_tokens(b'{"usage": null}', 3) == b'{"usage": null}'


def test_a_stream_is_passed_on_event_by_event_with_the_usage_rewritten():
    usage = {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}
    stream = (
        b'data: {"choices": [{"text": "a"}], "usage": null}\n\n'
        + b"data: "
        + json.dumps({"choices": [], "usage": usage}).encode()
        + b"\n\ndata: [DONE]\n\n"
    )
    events = SseRewriter(16)
    out = b"".join(events.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)) + events.flush()
    assert events.usage == {**usage, "prompt_tokens_details": {"cached_tokens": 16}}
    assert out.split(b"\n\n")[0] == stream.split(b"\n\n")[0]  # events without a usage pass unchanged
    assert out.endswith(b"data: [DONE]\n\n")
    plain = SseRewriter(None)
    assert plain.feed(stream) + plain.flush() == stream and plain.usage == usage


def test_the_baselines_order_each_leg_by_their_own_rule():
    scored = ranked(worker("p1"), worker("p2"), worker("d1", running=5), worker("d2", running=1))
    turns = [
        pd_plan(scored, ROLES, mode=SplitMode.ALWAYS, baseline=Baseline(True, t, random.Random(0))) for t in range(4)
    ]
    assert [(p.prefill[0].candidate.worker_id, p.decode[0].candidate.worker_id) for p in turns] == [
        ("p1", "d1"),
        ("p2", "d2"),
        ("p1", "d1"),
        ("p2", "d2"),
    ]
    least = pd_plan(scored, ROLES, mode=SplitMode.ALWAYS, baseline=Baseline(False, 0, random.Random(0)))
    assert least.decode[0].candidate.worker_id == "d2"


def test_decode_legs_that_take_longer_than_predicted_raise_the_next_splits_cost():
    legs = DecodeLegs(half_life=1.0)
    assert legs.residual_s("m") == 0.0
    legs.observe("m", predicted_s=0.010, observed_s=0.050)
    assert legs.residual_s("m") == pytest.approx(0.040) and legs.residual_s("other") == 0.0
    legs.observe("m", predicted_s=0.010, observed_s=0.010)
    assert legs.residual_s("m") == pytest.approx(0.020)  # half-life of one leg
    scored = ranked(worker("p1"), worker("d1", running=20))
    plain = pd_plan(scored, ROLES)
    costs = PdCosts(whole_on=WholeOn.DECODE, decode_weight=1.0)
    slow = plan(scored, ROLES, 64 * BS, BS, MODEL, costs, random.Random(1), None, residual_s=10.0)
    assert plain.split and not slow.split and slow.split_s == pytest.approx(plain.split_s + 10.0)


def test_a_store_connectors_prefill_reply_names_no_params_and_the_decode_leg_goes_as_sent():
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 9}
    assert json.loads(decode_leg_body(body, None)) == body


def test_a_degraded_decision_is_never_split_and_keeps_the_operators_whole_on():
    """It read no match: whole only, and still only where --pd-whole-on says (P2P NCCL producers
    cannot answer alone)."""
    costs = PdCosts(SplitMode.AUTO, 2.5, 0.0, WholeOn.DECODE, 1.0).unsplit()
    assert costs == PdCosts(SplitMode.NEVER, 2.5, 0.0, WholeOn.DECODE, 1.0)
    scored = ranked(worker("p1"), worker("d1", running=40), worker("d2", running=40))
    found = plan(scored, ROLES, 64 * BS, BS, MODEL, costs, random.Random(1), None)
    assert not found.split and {s.candidate.worker_id for s in found.whole} == {"d1", "d2"}
