"""The engine side of vLLM's KV-event wire: what vLLM 0.32/0.33's ZmqEventPublisher sends.

PUB frames ``[topic, seq (8 bytes big-endian), msgpack([ts, [event maps], dp_rank])]``, with seq
counting batches from 0 per process, and a ROUTER replay socket that answers a DEALER's
``[b"", start_seq]`` with ``[b"", topic, seq, payload]`` per buffered batch with seq >= start,
then ``[b"", b"", ff*8, b""]``. Event maps carry vLLM's keys in vLLM's order (docs/sim-engine.md,
"The KV-event wire", and the real server's captures in tests/fixtures/vllm-0.32-cpu/), so a
consumer cannot tell the two apart. The events are :mod:`kvevents.vllm`'s structs: the schema the
agent decodes with is the one this side encodes with.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq
import zmq.asyncio
from msgspec import UNSET

from kvevents.vllm import REPLAY_END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, Event, encode_payload, encode_seq
from kvservice.lifecycle import StartupError, listening

END_SEQ = encode_seq(REPLAY_END_SEQ)


def stored_event(
    block_hashes: Sequence[int | bytes],
    parent_block_hash: int | bytes | None,
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    lora_id: int | None = None,
    extra_keys: Sequence[Any] | None = None,
    medium: str = "GPU",
    group_idx: int = 0,
    kv_cache_spec_kind: str = "full_attention",
    kv_cache_spec_sliding_window: int | None = None,
) -> BlockStored:
    """A store as vLLM 0.32 sends it: every key it sends, ``extra_keys`` one per block.

    A sliding-window group's store carries the tokens of its whole span but the hashes of the
    blocks it kept only, possibly none; then vLLM's ``extra_keys`` is None, which its encoder
    leaves out of the map (as it leaves out ``kv_cache_spec_sliding_window`` for other groups),
    so both are UNSET here: the wire holds the same keys."""
    keys: Any = UNSET  # Any: the struct's type says None for a key vLLM leaves out
    if block_hashes:
        keys = tuple(extra_keys) if extra_keys is not None else (None,) * len(block_hashes)
    return BlockStored(
        block_hashes=tuple(block_hashes),
        parent_block_hash=parent_block_hash,
        token_ids=tuple(token_ids),
        block_size=block_size,
        lora_id=lora_id,
        medium=medium,
        lora_name=lora_name,
        extra_keys=keys,
        group_idx=group_idx,
        kv_cache_spec_kind=kv_cache_spec_kind,
        kv_cache_spec_sliding_window=UNSET if kv_cache_spec_sliding_window is None else kv_cache_spec_sliding_window,
    )


def removed_event(block_hashes: Sequence[int | bytes], *, medium: str = "GPU", group_idx: int = 0) -> BlockRemoved:
    return BlockRemoved(tuple(block_hashes), medium=medium, group_idx=group_idx)


def cleared_event() -> AllBlocksCleared:
    return AllBlocksCleared()


class EventSink(Protocol):
    """Where the engine's batches go: a ZMQ publisher (vLLM, SGLang) or an event queue fetched
    over HTTP (TensorRT-LLM: sim_engine/trtllm_events.py)."""

    @property
    def next_seq(self) -> int: ...

    async def publish(self, events: Sequence[Event], *, deliver: bool = True) -> list[bytes]: ...


class KVEventPublisher:
    """Publishes batches like one vLLM engine process (one data-parallel rank)."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        dp_rank: int = 0,
        bind: bool = False,
        encode: Callable[[Sequence[Event], int], bytes] = encode_payload,
    ) -> None:
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self._encode = encode  # the engine's wire: vLLM's, or kvevents.sglang's
        self._pub = context.socket(zmq.PUB)
        self._router: zmq.asyncio.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, 100_000)
            self._pub.setsockopt(zmq.LINGER, 0)
            # vLLM's rule (unless told to bind): bind wildcards, connect to a named host
            bind = bind or "*" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
            _attach(self._pub, endpoint, bind, "KV events", "--events-endpoint")
            if replay_endpoint is not None:
                self._router = context.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                _attach(self._router, replay_endpoint, True, "KV-event replay", "--replay-endpoint")
        except BaseException:
            self._close_sockets()
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._replay_task: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        """The bound PUB endpoint (with the real port when bound to ``*``)."""
        return self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]

    @property
    def replay_endpoint(self) -> str | None:
        return self._router.getsockopt(zmq.LAST_ENDPOINT).decode() if self._router else None  # type: ignore[union-attr]

    @property
    def next_seq(self) -> int:
        return self._seq

    def start(self) -> KVEventPublisher:
        if self._router is not None and self._replay_task is None:
            self._replay_task = asyncio.create_task(self._serve_replay())
        return self

    async def publish(self, events: Sequence[Event], *, deliver: bool = True) -> list[bytes]:
        """Publish one batch; returns its frames. ``deliver=False`` keeps it for replay but does
        not send it, as when a subscriber's queue overflows (fault injection for tests)."""
        seq = self._seq
        self._seq += 1
        payload = self._encode(events, self.dp_rank)
        self._buffer.append((seq, payload))
        frames = [self.topic, encode_seq(seq), payload]
        if deliver:
            await self._pub.send_multipart(frames)
        return frames

    async def send_raw(self, frames: Sequence[bytes]) -> None:
        """Send arbitrary frames on the PUB socket (a broken or hostile publisher)."""
        await self._pub.send_multipart(list(frames))

    def restart(self) -> None:
        """Behave like a new engine process: seq from 0, nothing buffered."""
        self._seq = 0
        self._buffer.clear()

    async def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_frame = frames
            start = int.from_bytes(start_frame, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._router.send_multipart([client, b"", self.topic, encode_seq(seq), payload])
            await self._router.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            # A replay stuck in a send (to a subscriber that refused the message and went away)
            # may not end at once: the sockets are closed after a bound wait whatever it does.
            # (Waited for without a bound, a test's teardown hung the whole suite once.)
            await asyncio.wait({self._replay_task}, timeout=2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)


def _attach(socket: zmq.asyncio.Socket, endpoint: str, bind: bool, what: str, flag: str) -> None:
    """Bind or connect; any failure is a one-line :class:`StartupError` naming ``flag``."""
    try:
        with listening(what, endpoint, flag):
            if bind:
                socket.bind(endpoint)
            else:
                socket.connect(endpoint)
    except zmq.ZMQError as exc:  # not a busy or foreign address: a malformed endpoint
        verb = "listen on" if bind else "connect to"
        raise StartupError(f"cannot {verb} {endpoint} for {what}: {exc}; pass another {flag}") from None
