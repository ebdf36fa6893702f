"""The TTFT model the router learns online (pure)."""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.routing.ttft import PRIOR_PER_TOKEN_S, REFIT_SHARE, CostModel, TtftLearner, TtftParams


def _feed(learner: TtftLearner, worker: str, base: float, per_token: float, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(count):
        tokens = rng.uniform(0, 4000)
        learner.observe(worker, tokens, (base + per_token * tokens) * rng.uniform(0.95, 1.05))


def test_it_learns_each_workers_rate_and_the_fleets_base():
    learner = TtftLearner()
    _feed(learner, "fast", base=0.020, per_token=1e-4, count=400, seed=1)
    _feed(learner, "slow", base=0.020, per_token=4e-4, count=400, seed=2)
    fast, slow = learner.model.params("fast"), learner.model.params("slow")
    assert fast.per_token_s == pytest.approx(1e-4, rel=0.25) and slow.per_token_s == pytest.approx(4e-4, rel=0.25)
    assert fast.base_s == slow.base_s == learner.model.fleet.base_s  # one intercept for the fleet
    # The same prefill predicts a longer wait on the slow worker.
    assert slow.seconds(2000) > 2 * fast.seconds(2000)


def test_a_worker_seen_a_few_times_leans_on_the_fleet():
    learner = TtftLearner()
    _feed(learner, "old", base=0.0, per_token=2e-4, count=300)
    learner.observe("new", 1000, 5.0)  # one outlier
    learner.snapshot()  # fitted with every observation (the model may be a few behind)
    assert "new" in learner.model.rates
    new = learner.model.params("new")
    assert new.per_token_s < 5e-4 and new.seconds(1000) < 1.0
    assert learner.model.params("never-seen") == learner.model.fleet


def test_without_spread_in_prefill_sizes_the_slope_keeps_the_prior():
    learner = TtftLearner()
    for _ in range(100):
        learner.observe("w", 512, 0.05)
    params = learner.model.params("w")
    assert params.per_token_s == pytest.approx(PRIOR_PER_TOKEN_S, rel=0.05)
    assert params.seconds(512) == pytest.approx(0.05, rel=0.3)


def test_reuse_and_typical_request_are_measured():
    learner = TtftLearner()
    for _ in range(2000):
        learner.note_usage(prompt_tokens=1000, cached_tokens=800)
        learner.note_request(uncached_tokens=200)
    assert learner.model.reuse == pytest.approx(0.8, abs=0.01)
    assert learner.model.typical_uncached_tokens == pytest.approx(200, rel=0.01)


@given(st.lists(st.tuples(st.floats(0, 1e6), st.floats(0, 1e3)), max_size=60))
def test_learned_parameters_are_never_negative(observations):
    learner = TtftLearner()
    for tokens, seconds in observations:
        learner.observe("w", tokens, seconds)
    params = learner.model.params("w")
    assert params.base_s >= 0 and params.per_token_s >= 0
    assert isinstance(params, TtftParams)


def test_the_fleets_utilization_is_the_average_busy_share_at_decisions():
    learner = TtftLearner()
    assert learner.model.utilization == pytest.approx(0.5)  # the prior: the unmeasured weighting
    for _ in range(1000):
        learner.note_busy(0.25)
    assert learner.model.utilization == pytest.approx(0.25, abs=0.01)
    for _ in range(1000):
        learner.note_busy(3.0)  # clamped to a share
    assert learner.model.utilization == pytest.approx(1.0, abs=0.01)


def test_whole_replies_teach_the_prefill_apart_from_the_decode_until_streamed_requests_are_seen():
    learner = TtftLearner()
    rng = random.Random(3)
    for _ in range(300):  # not streamed: 15 ms, the prefill at 5e-5 s a token, then 10 ms a reply token
        tokens, completion = rng.uniform(0, 4000), rng.randint(1, 16)
        seconds = (0.015 + 5e-5 * tokens + 0.010 * completion) * rng.uniform(0.97, 1.03)
        learner.observe("w", tokens, seconds, whole_reply=True, completion_tokens=completion)
    params = learner.model.params("w")
    assert params.per_token_s == pytest.approx(5e-5, rel=0.2)  # not the prior's 1e-4
    assert params.base_s == pytest.approx(0.015, abs=0.01)  # not the ~85 ms the decode adds on average
    assert learner.snapshot()["decode_ms_per_token"] == pytest.approx(10, rel=0.2)
    # Once streamed requests are seen, their first bytes decide, base and rate.
    _feed(learner, "w", base=0.010, per_token=2e-4, count=300)
    params = learner.model.params("w")
    assert params.per_token_s == pytest.approx(2e-4, rel=0.25) and params.base_s == pytest.approx(0.010, abs=0.01)


def test_a_prefill_lost_in_the_noise_still_lets_the_decode_be_learned():
    """Small prompts on a fast engine: the prefill's share is below the noise and the joint fit's
    slope comes out negative. The decode is still learned (the prefill at the prior's rate),
    not dropped into the base."""
    learner = TtftLearner()
    rng = random.Random(5)
    # A prefill of 2 us a token (1 ms for 512) under +-3 ms of noise and a drift that falls with
    # the prompt's size (-4 us a token), so the fitted slope is negative; 1 ms a reply token.
    for i in range(40):
        tokens, completion = 64 * (1 + i % 8), 1 + (i * 7) % 48
        seconds = 0.002 + 2e-6 * tokens + 0.001 * completion + rng.uniform(-0.003, 0.003) - 4e-6 * (tokens - 288)
        learner.observe("w", tokens, seconds, whole_reply=True, completion_tokens=completion)
    assert learner.snapshot()["decode_ms_per_token"] == pytest.approx(1.0, rel=0.2)
    assert learner.model.params("w").per_token_s > 0


def test_a_decode_that_cannot_be_told_apart_leaves_the_prefill_fit_alone():
    """Replies of one length: their decode is a constant, in the base; replies as long as their
    prompts: prefill and decode are collinear and the slope takes both (never a negative term)."""
    rng = random.Random(4)
    fixed, collinear = TtftLearner(), TtftLearner()
    for _ in range(300):
        tokens = rng.uniform(0, 4000)
        fixed.observe("w", tokens, 0.080 + 5e-5 * tokens, whole_reply=True, completion_tokens=8)
        collinear.observe(
            "w", tokens, 5e-5 * tokens + 0.001 * tokens / 100, whole_reply=True, completion_tokens=int(tokens / 100)
        )
    assert fixed.model.params("w").per_token_s == pytest.approx(5e-5, rel=0.1)  # the fleet's, shrunk to the prior
    assert fixed.model.params("w").base_s == pytest.approx(0.080, rel=0.1)  # (shrunk a little to the prior)
    assert fixed.snapshot()["decode_ms_per_token"] is None
    assert collinear.model.params("w").per_token_s >= 5e-5 and collinear.model.params("w").base_s >= 0


@given(st.lists(st.tuples(st.floats(0, 1e6), st.floats(0, 1e3), st.integers(0, 4096)), max_size=60))
def test_whole_reply_fits_are_never_negative(observations):
    learner = TtftLearner()
    for tokens, seconds, completion in observations:
        learner.observe("w", tokens, seconds, whole_reply=True, completion_tokens=completion)
    params = learner.model.params("w")
    decode = learner.snapshot()["decode_ms_per_token"]
    assert params.base_s >= 0 and params.per_token_s >= 0 and (decode is None or decode >= 0)


def test_the_snapshot_says_what_set_the_rate_and_each_workers_rate():
    learner = TtftLearner()
    assert learner.snapshot()["source"] == "prior"
    assert learner.snapshot()["prefill_tokens_per_s"] == pytest.approx(1 / PRIOR_PER_TOKEN_S)
    rng = random.Random(3)
    for _ in range(50):  # whole replies only: they set the rate
        tokens = rng.uniform(0, 4000)
        learner.observe("w1", tokens, 0.2 + tokens / 20_000, whole_reply=True, completion_tokens=16)
    assert learner.snapshot()["source"] == "whole_replies"
    _feed(learner, "fast", base=0.010, per_token=1e-4, count=300, seed=4)
    _feed(learner, "slow", base=0.010, per_token=5e-4, count=300, seed=5)
    snapshot = learner.snapshot()
    assert snapshot["source"] == "streamed" and snapshot["base_ms"] >= 0
    rates = {w["id"]: w for w in snapshot["workers"]}
    assert rates["fast"]["prefill_tokens_per_s"] == pytest.approx(10_000, rel=0.25)
    assert rates["slow"]["prefill_tokens_per_s"] == pytest.approx(2_000, rel=0.25)
    assert rates["fast"]["observations"] > 100 and rates["fast"]["whole_reply_observations"] == 0
    assert rates["w1"]["whole_reply_observations"] > 10 and rates["w1"]["observations"] == 0
    learner.note_busy(1.0)
    assert learner.snapshot()["utilization"] > snapshot["utilization"]


STEPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("observe"), st.sampled_from(["w1", "w2"]), st.floats(0, 4000), st.floats(0, 2), st.booleans()
        ),
        st.tuples(st.just("request"), st.floats(0, 4000)),
        st.tuples(st.just("usage"), st.integers(1, 4000), st.integers(0, 4000)),
        st.tuples(st.just("busy"), st.floats(0, 1)),
        st.tuples(st.just("forget"), st.sampled_from(["w1", "w2"])),
    ),
    max_size=40,
)


@given(STEPS, st.lists(st.booleans(), min_size=40, max_size=40))
def test_the_model_read_at_any_time_is_the_one_fitted_from_everything_seen(steps, reads):
    """The cost model is rebuilt when read, not at each observation: whenever it is read (while
    fewer than REFIT_SHARE observations are held), it is what a fit of everything seen so far gives."""
    learner = TtftLearner()
    for step, read in zip(steps, reads, strict=False):
        kind, *args = step
        if kind == "observe":
            worker, tokens, seconds, whole = args
            learner.observe(worker, tokens, seconds, whole_reply=whole, completion_tokens=8 if whole else 0)
        elif kind == "request":
            learner.note_request(*args)
        elif kind == "usage":
            learner.note_usage(args[0], min(args[1], args[0]))
        elif kind == "busy":
            learner.note_busy(*args)
        else:
            learner.forget(*args)
        if read:
            assert learner.model == _fitted_afresh(learner)
    assert learner.model == _fitted_afresh(learner)


def _fitted_afresh(learner: TtftLearner) -> CostModel:
    twin = copy.deepcopy(learner)
    twin._refit()  # every figure fitted again from its sums
    return twin._model


def test_equal_engines_share_the_fleets_rate_and_a_slower_one_keeps_its_own():
    """Equal engines measure rates a few percent apart (the traffic each gets, how much it
    batches): each is given the fleet's, so that a cold prompt does not go to the "fastest" every
    time; an engine slower by more than SAME_RATE_WITHIN keeps what it measured."""
    learner = TtftLearner()
    for i, per_token in enumerate((1.0e-4, 1.08e-4, 0.92e-4)):
        _feed(learner, f"equal{i}", base=0.010, per_token=per_token, count=300, seed=10 + i)
    rates = {learner.model.params(f"equal{i}").per_token_s for i in range(3)}
    assert len(rates) == 1 and rates.pop() == pytest.approx(1e-4, rel=0.1)  # one rate: the typical worker's
    _feed(learner, "slow", base=0.010, per_token=2e-4, count=300, seed=20)
    assert learner.model.params("slow").per_token_s == pytest.approx(2e-4, rel=0.2)
    # the slow one does not pull the others' rate toward it (the fleet's own fit would)
    assert learner.model.params("equal0").per_token_s == pytest.approx(1e-4, rel=0.1)
    assert len({learner.model.params(f"equal{i}").per_token_s for i in range(3)}) == 1


def test_a_rate_told_apart_only_by_noise_is_the_typical_one():
    """Whole replies on engines that share CPU cores vary 2-4x with what else runs: a worker whose
    few dozen noisy observations fit a rate half the others' is within the noise of them, and
    keeps the typical rate (issue 55: it drew every cold prompt); the same gap measured on clean
    observations is a real difference."""

    def feed(learner: TtftLearner, worker: str, per_token: float, noise: float, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(40):
            tokens = rng.uniform(0, 1000)
            learner.observe(worker, tokens, (0.02 + per_token * tokens) * rng.uniform(1 - noise, 1 + noise) ** 2)

    for noise, kept in ((0.6, False), (0.02, True)):
        learner = TtftLearner()
        for i in range(3):
            feed(learner, f"equal{i}", 2e-5, noise, seed=i)
        feed(learner, "lucky", 1e-5, noise, seed=9)
        learner.snapshot()
        own = learner.model.params("lucky").per_token_s
        assert (own < 0.7 * learner.model.params("equal0").per_token_s) is kept


def test_with_many_observations_held_the_fit_waits_for_a_share_of_new_ones():
    """One observation more moves a fit of n by ~1/n: past REFIT_SHARE of them the model is
    fitted again after every n / REFIT_SHARE new ones, never further behind; an operator's
    snapshot fits everything seen."""
    learner = TtftLearner()
    _feed(learner, "w1", base=0.01, per_token=1e-4, count=600, seed=3)
    fitted = learner.model
    assert fitted == _fitted_afresh(learner)
    held = learner._fleet.n
    due = int(held / REFIT_SHARE) + 1
    assert due >= 3
    for i in range(1, due + 1):
        learner.observe("w1", 3000, 2.0)  # much slower than learned: every fit moves
        if i < held / REFIT_SHARE:
            assert learner.model.rates == fitted.rates, i  # not fitted yet
    assert learner.model.rates != fitted.rates
    assert learner.model == _fitted_afresh(learner)
    learner.observe("w1", 3000, 2.0)
    assert learner.model.rates != _fitted_afresh(learner).rates
    learner.snapshot()
    assert learner.model == _fitted_afresh(learner)


def _h200(new: float, cached: float, ns: float = 2.0, per_token_us: float = 18.5) -> float:
    """issue 37's measurement on one H200 (Llama-3.1-8B shape, bf16): 7 ms + 18.5 us x N + 2.0 ns x N x (P + N/2)."""
    return 0.007 + per_token_us * 1e-6 * new + ns * 1e-9 * new * (cached + new / 2)


def _feed_contexts(learner: TtftLearner, worker: str, count: int, seed: int, **model: float) -> None:
    from router.routing.ttft_fit import attention_work

    rng = random.Random(seed)
    for _ in range(count):
        prompt = rng.uniform(1_000, 32_000)
        cached = prompt * rng.uniform(0.0, 0.97)
        new = prompt - cached
        seconds = _h200(new, cached, **model) * rng.uniform(0.97, 1.03)
        learner.observe(worker, new, seconds, attention=attention_work(new, cached))


def test_time_that_grows_with_the_context_is_learned():
    """Prefills of 1k-32k prompts, 0-97% cached, timed as measured on an H200: the learned model
    recovers the per-token rate and attention's share, and predicts what a chunk after a long
    context costs (992 new tokens after 31,776 cached: the formula's 89 ms, 104 ms measured,
    against 26 ms cold)."""
    from router.routing.ttft_fit import attention_work

    learner = TtftLearner()
    _feed_contexts(learner, "h200", 600, seed=3)
    snapshot = learner.snapshot()
    assert snapshot["prefill_context_ns"] == pytest.approx(2.0, rel=0.1)
    # (shrunk a little towards the 10k tokens/s prior, as every learned rate is)
    assert snapshot["prefill_tokens_per_s"] == pytest.approx(1 / 18.5e-6, rel=0.25)
    params = learner.model.params("h200")
    late = params.seconds(992, attention_work(992, 31_776))
    assert late == pytest.approx(_h200(992, 31_776), rel=0.1)
    cold = params.seconds(992, attention_work(992, 0))
    assert cold == pytest.approx(_h200(992, 0), rel=0.15) and late > 3 * cold  # the formula's 3.4x


def test_without_contexts_that_vary_attention_keeps_its_prior_of_nothing():
    learner = TtftLearner()
    _feed(learner, "w", base=0.01, per_token=1e-4, count=300)  # no attention work given
    assert learner.model.params("w").per_context_s == 0 and learner.snapshot()["prefill_context_ns"] == 0


def test_a_slower_gpu_keeps_its_own_attention_rate():
    """A Qwen2.5-32B-shaped engine (88.5 us per token, 6.2 ns of attention) beside Llama-8B ones."""
    learner = TtftLearner()
    for i in range(3):
        _feed_contexts(learner, f"fast{i}", 400, seed=i)
    _feed_contexts(learner, "big", 400, seed=9, ns=6.2, per_token_us=88.5)
    fast, big = learner.model.params("fast0"), learner.model.params("big")
    assert big.per_token_s == pytest.approx(88.5e-6, rel=0.3) and fast.per_token_s == pytest.approx(18.5e-6, rel=0.3)
    assert big.per_context_s > 2 * fast.per_context_s


@given(st.lists(st.tuples(st.floats(0, 30_000), st.floats(0, 2e5), st.floats(0, 5)), min_size=1, max_size=60))
def test_no_learned_rate_is_ever_negative_with_attention(observations):
    learner = TtftLearner()
    for tokens, attention, seconds in observations:
        learner.observe("w", tokens, seconds, attention=attention)
    params = learner.model.params("w")
    assert min(params.base_s, params.per_token_s, params.per_context_s) >= 0


def test_without_a_rate_fitted_for_the_fleet_no_worker_is_told_apart():
    """Whole replies whose prefill is lost in the noise (the fleet's fit keeps its prior, 4x slower
    than the engines): one worker whose few replies happen to fit a slope would stand far from
    that prior and draw every cold prompt (issue 55: 56 of 128 requests); it keeps the fleet's."""
    learner = TtftLearner()
    rng = random.Random(5)
    for worker, slope in (("a", -2e-5), ("b", -2e-5), ("c", -2e-5), ("lucky", 2.5e-5)):
        for _ in range(30):
            tokens = rng.uniform(0, 1000)
            learner.observe(worker, tokens, 0.06 + slope * tokens, whole_reply=True, completion_tokens=8)
    learner.snapshot()
    assert learner.model.params("lucky") == learner.model.params("a") == learner.model.fleet


def test_a_fleet_whose_workers_were_all_forgotten_keeps_its_fleet_rate():
    """The fleet's sums outlive its workers' (forget): a refit with no worker left gives the
    fleet's rate to everyone and tells none apart (no worker errors to take a median of)."""
    learner = TtftLearner()
    for i in range(40):
        learner.observe("gone", 200 + 100 * i, 0.01 + 1e-4 * (200 + 100 * i))
    learner.forget("gone")
    model = learner.model
    assert model.rates == {}
    assert model.params("gone").per_token_s == pytest.approx(model.fleet.per_token_s)
    assert model.fleet.per_token_s == pytest.approx(1e-4, rel=0.2)
