"""Redis loses its data (FLUSHALL, an empty restart) while routers keep their caches: a router
must never credit one worker with another's blocks afterwards (gids are never handed out again)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from redis.asyncio import Redis

from kvindex.hashing import sequence_hashes
from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvindex.types import StoredRun, WorkerInfo
from kvroute.devstack.embedded_redis import RedisServer

LONG_TTL = 600_000
MODEL = "tiny"
PROMPTS = {name: sequence_hashes([i] * 16 + list(range(640)), 16) for i, name in enumerate(("e0", "e1"))}


def info(name: str) -> WorkerInfo:
    return WorkerInfo(name, MODEL, f"http://{name}", 16)


async def register_and_fill(writer: RedisIndex, order: tuple[str, ...]) -> None:
    """The agents (re)register in ``order``, then each writes its own prompt's 41 blocks."""
    for name in order:
        await writer.register(info(name), LONG_TTL)
    for name in order:
        await writer.handle(MODEL, name).store([StoredRun(None, tuple(PROMPTS[name]))])


async def check_credits(reader: RedisIndex) -> None:
    for name, chain in PROMPTS.items():
        other = "e1" if name == "e0" else "e0"
        assert await reader.match(MODEL, chain) == {name: len(chain), other: 0}


async def rounds_of_data_loss(server: RedisServer, lose_data: Callable[[], Awaitable[RedisServer]]) -> None:
    writer_client, reader_client = RedisSettings(url=server.url).client(), RedisSettings(url=server.url).client()
    writer, reader = RedisIndex(writer_client), RedisIndex(reader_client)
    try:
        await register_and_fill(writer, ("e0", "e1"))
        await check_credits(reader)  # the reader now caches both gids' names
        for round_ in range(4):
            server = await lose_data()
            assert await reader.match(MODEL, PROMPTS["e0"]) == {}
            await register_and_fill(writer, ("e1", "e0") if round_ % 2 == 0 else ("e0", "e1"))
            await check_credits(reader)
    finally:
        await writer_client.aclose()
        await reader_client.aclose()
        server.stop()


async def test_a_flushall_never_makes_a_reader_credit_the_wrong_worker(private_redis):
    async def flush() -> RedisServer:
        admin = Redis.from_url(private_redis.url)
        await admin.flushall()
        await admin.aclose()
        return private_redis

    await rounds_of_data_loss(private_redis, flush)


@pytest.mark.faults
async def test_an_empty_restart_never_makes_a_reader_credit_the_wrong_worker(private_redis):
    server = private_redis

    async def restart() -> RedisServer:
        nonlocal server
        server.stop(kill=True)
        server = RedisServer(binary=server.binary, port=server.port).start()  # same port, empty
        return server

    await rounds_of_data_loss(private_redis, restart)
