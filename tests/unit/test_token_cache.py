"""router.prompts.token_cache: /tokenize answers kept by their total size."""

from __future__ import annotations

from array import array

import pytest

from router.prompts.token_cache import TokenCache


def _ids(n: int, first: int = 0) -> array:
    return array("I", range(first, first + n))


def test_the_cache_holds_at_most_its_token_budget_least_recently_used_out_first():
    cache = TokenCache(max_tokens=1000)
    cache.put("a", _ids(250))
    cache.put("b", _ids(250))
    cache.put("c", _ids(250))
    assert cache.get("a") == _ids(250)  # a is now the most recent
    cache.put("d", _ids(250))
    cache.put("e", _ids(100))
    assert cache.tokens <= 1000 and cache.get("b") is None
    assert cache.get("a") is not None and cache.get("e") == _ids(100)


def test_an_answer_over_a_quarter_of_the_budget_is_not_kept_and_flushes_nothing():
    cache = TokenCache(max_tokens=1000)
    cache.put("small", _ids(10))
    cache.put("huge", _ids(251))
    assert cache.get("huge") is None and cache.get("small") is not None and cache.tokens == 10


def test_a_key_put_again_is_counted_once():
    cache = TokenCache(max_tokens=1000)
    cache.put("a", _ids(200))
    cache.put("a", _ids(100, first=5))
    assert cache.tokens == 100 and len(cache) == 1 and cache.get("a") == _ids(100, first=5)


def test_a_budget_below_one_token_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        TokenCache(0)
