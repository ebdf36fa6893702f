"""The sampling fields' rules (kvtokens/sampling.py): what vLLM refuses with 400 is refused here,
naming the field; what it takes passes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtokens.sampling import NUMBERS, SamplingError, check_context_length, check_sampling


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"temperature": "hot"}, "temperature", "'temperature' must be a number of at least 0, got 'hot'"),
        ({"temperature": -0.1}, "temperature", "at least 0"),
        ({"n": 0}, "n", "'n' must be an integer of at least 1, got 0"),
        ({"n": 1.5}, "n", "an integer"),
        ({"n": True}, "n", "got True"),
        ({"top_p": 0}, "top_p", "above 0 and at most 1"),
        ({"top_p": 1.01}, "top_p", "above 0 and at most 1"),
        ({"top_k": -2}, "top_k", "-1 or 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "from -2 to 2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "above 0"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"max_tokens": "9"}, "max_tokens", "got '9'"),
        ({"seed": 1.5}, "seed", "an integer"),
        ({"stop": 7}, "stop", "a string or an array of strings"),
        ({"stop": ["a", 1]}, "stop", "a string or an array of strings"),
        ({"temperature": "x" * 500}, "temperature", "..."),
    ],
)
def test_a_field_out_of_its_rule_is_refused_by_name_in_one_line(body, param, words):
    with pytest.raises(SamplingError) as error:
        check_sampling(body)
    assert error.value.param == param and words in str(error.value)
    assert "\n" not in str(error.value) and len(str(error.value)) < 200


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"temperature": 0, "top_p": 1, "top_k": -1, "n": 2, "max_tokens": None, "stop": "\n", "seed": -3},
        {"temperature": 1.7, "top_k": 0, "min_p": 0.05, "frequency_penalty": -2, "stop": ["a", "b"], "n": 2.0},
        {"max_completion_tokens": 5, "min_tokens": 0, "repetition_penalty": 1.1, "best_of": 3, "seed": 2**80},
    ],
)
def test_what_vllm_takes_passes(body):
    check_sampling(body)


@given(st.dictionaries(st.sampled_from(sorted(NUMBERS)), st.one_of(st.none(), st.integers(), st.floats(), st.text())))
def test_any_value_is_taken_or_refused_with_a_sampling_error(body):
    try:
        check_sampling(body)
    except SamplingError as exc:
        assert exc.param in body


def test_a_request_longer_than_the_models_context_is_refused_as_vllm_does():
    with pytest.raises(SamplingError) as error:
        check_context_length({"prompt": "x"}, 5000, 4096)
    assert error.value.param == "prompt" and "maximum context length is 4096 tokens" in str(error.value)
    assert "your prompt has 5000 tokens" in str(error.value)
    with pytest.raises(SamplingError) as error:
        check_context_length({"messages": [], "max_completion_tokens": 200}, 4000, 4096)
    assert error.value.param == "max_completion_tokens"
    assert "requested 4200 tokens (4000 in the prompt" in str(error.value)
    check_context_length({"prompt": "x", "max_tokens": 96}, 4000, 4096)  # fits exactly
    check_context_length({"prompt": "x"}, 10**6, None)  # the length not known: the engine judges
