"""The one retry policy's classes of a script call's reply (kvindex.scripts.outcome)."""

from __future__ import annotations

import pytest
from redis.exceptions import AskError, MovedError, NoScriptError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvindex.scripts import Outcome, outcome


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (b"a reply", Outcome.ANSWER),
        ([1, 2], Outcome.ANSWER),
        (None, Outcome.ANSWER),
        (ResponseError("kvroute: stale generation"), Outcome.ANSWER),  # the script's own error
        (NoScriptError("NOSCRIPT No matching script"), Outcome.NO_SCRIPT),
        (MovedError("3999 127.0.0.1:6381"), Outcome.NOT_DELIVERED),
        (AskError("3999 127.0.0.1:6381"), Outcome.NOT_DELIVERED),
        (TryAgainError("TRYAGAIN"), Outcome.NOT_DELIVERED),
        (RedisConnectionError("Connection closed by server."), Outcome.NOT_DELIVERED),
        (RedisTimeoutError("Timeout reading from socket"), Outcome.NOT_DELIVERED),
    ],
)
def test_each_reply_is_an_answer_a_missing_script_or_not_delivered(reply, expected):
    assert outcome(reply) is expected
