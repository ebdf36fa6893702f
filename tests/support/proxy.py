"""A TCP proxy that makes a server slow: every chunk of bytes, either way, is delivered
``latency_s`` after it was read (order kept, throughput not limited). Put it between a process and
its Redis to get a slow or distant Redis with a real server behind it:

    proxy = await LatencyProxy(redis_server.port, latency_s=0.2).start()
    ... RouterSettings(redis=RedisSettings(url=proxy.url)) ...
    proxy.latency_s = 0.0   # takes effect for the bytes read from then on
    await proxy.stop()

``accepted`` counts the connections the proxied process opened (a reconnect storm shows there),
``open`` the ones open now, and ``upstream_ports`` the local ports of the proxy's connections to
the server now (to find them in the server's CLIENT LIST: ``addr`` ends with one of them).
``hold()`` / ``release()`` keep every byte back meanwhile (a network partition that resets
nothing: what a SIGSTOPped server looks like from the client).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

CHUNK = 64 * 1024


@dataclass
class LatencyProxy:
    target_port: int
    latency_s: float = 0.0
    target_host: str = "127.0.0.1"
    accepted: int = 0
    open: int = 0
    upstream_ports: set[int] = field(default_factory=set)
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _released: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> LatencyProxy:
        self._released.set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    def hold(self) -> None:
        self._released.clear()

    def release(self) -> None:
        self._released.set()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.accepted += 1
        self.open += 1
        upstream_writer: asyncio.StreamWriter | None = None
        upstream_port = 0
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(self.target_host, self.target_port)
            upstream_port = upstream_writer.get_extra_info("sockname")[1]
            self.upstream_ports.add(upstream_port)
            async with asyncio.TaskGroup() as pipes:  # one side failing ends the other
                pipes.create_task(self._pipe(client_reader, upstream_writer))
                pipes.create_task(self._pipe(upstream_reader, client_writer))
        except* (OSError, asyncio.CancelledError):
            # Either side went away: close both. Cancelled (stop()): end here, since asyncio's
            # server callback reads the task's exception and would raise a cancellation.
            pass
        finally:
            self.open -= 1
            self.upstream_ports.discard(upstream_port)
            self._tasks.discard(task)
            for writer in (client_writer, upstream_writer):
                if writer is not None:
                    writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy one direction, each chunk ``latency_s`` after it was read; EOF closes the other side."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                await asyncio.sleep(max(0.0, due - loop.time()))
                await self._released.wait()
                writer.write(data)
                await writer.drain()

        delivering = asyncio.create_task(deliver())
        try:
            while data := await reader.read(CHUNK):
                queue.put_nowait((loop.time() + self.latency_s, data))
            queue.put_nowait((0.0, b""))
            await delivering
        finally:
            delivering.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await delivering
            with contextlib.suppress(OSError):
                if writer.can_write_eof():
                    writer.write_eof()
