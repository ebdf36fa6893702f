"""What the router tells a client when every try of a worker failed before replying."""

from __future__ import annotations

import pytest

from router.upstream.http1 import UpstreamBroken
from router.upstream.proxy import failure_text


@pytest.mark.parametrize(
    ("why", "said"),
    [
        (503, "it answered 503"),
        (302, "it answered with a redirect (302, not followed)"),
        (TimeoutError(), "it timed out"),
        (ConnectionRefusedError(111, "Connect call failed ('10.0.0.7', 8000)"), "the connection failed"),
        (
            UpstreamBroken("the worker closed the connection before its reply ended"),
            "the worker closed the connection before its reply ended",
        ),
        (
            UpstreamBroken("the worker's reply is not valid HTTP/1.1 (Invalid method encountered)"),
            "the worker's reply is not valid HTTP/1.1 (Invalid method encountered)",
        ),
        (ValueError("x"), "the exchange failed (ValueError)"),
    ],
)
def test_a_failure_says_what_went_wrong_without_the_address(why: BaseException | int, said: str):
    assert failure_text(why) == said
    assert "10.0.0.7" not in failure_text(why)
