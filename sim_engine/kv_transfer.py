"""Prefill/decode disaggregation between simulated engines: vLLM 0.32's NIXL connector (pull mode,
every engine ``kv_both``) as a router sees it, with HTTP in place of NIXL
(vllm/distributed/kv_transfer/kv_connector/v1/nixl/: pull_scheduler.py, base_scheduler.py,
base_worker.py, pull_worker.py). The scheduler's side of a decode leg is sim_engine/decode_legs.py;
the request parameters and the HTTP endpoints are sim_engine/kv_transfer_api.py's.

* **The prefill leg** (``kv_transfer_params.do_remote_decode``): the request runs as any other;
  when it finishes (not when aborted) its blocks are kept, counted as used, and its reply's
  ``kv_transfer_params`` name them (:meth:`KVConnector.hold`: ``request_finished``'s dict, with
  ``remote_prefill_cached_tokens`` when it finished on its first token). They are kept under a
  lease of ``timeout_s`` (vLLM's ``kv_lease_duration``, 30 s), which each heartbeat of a decode
  engine holding a request for them extends to 2/3 of that from now; then they are freed as vLLM
  frees a finished request's blocks (its cached ones stay in the prefix cache, evictable).
* **The pull**: ``remote_host``/``remote_port`` are the prefill engine's HTTP address (NIXL's side
  channel in vLLM); the decode engine posts ``POST /kv_transfer/pull`` ``{"remote_engine_id",
  "remote_request_id", "remote_block_ids", "read_s"}`` there. The prefill engine checks it still
  holds them (its engine id, the request, the blocks), keeps them while the read lasts
  (``read_s``: the decode engine's ``ms_per_1k_tokens`` for the tokens it pulls), frees them and
  answers ``{"token_ids"}``; a 404 when it does not hold them. An empty block list frees them
  unread (a decode leg aborted before it was admitted). ``POST /kv_transfer/heartbeat``
  ``{"remote_engine_id", "request_ids"}``: the decode engine's heartbeats, every ``timeout_s / 6``
  for each request it holds that has not pulled yet.
* **The decode leg** (``do_remote_prefill``): admitted with its local hit, it pulls the rest of the
  prompt asynchronously (:meth:`KVConnector.pull`); a pull that fails (no connection, the blocks
  no longer held, another prompt's KV) fails the request (vLLM's ``kv_load_failure_policy``
  "fail"), and the engine serves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from sim_engine.block_pool import Block
from sim_engine.types import FAILED, PULLED, PULLING, UNREAD, RemotePrefill, SimRequest, cdiv

if TYPE_CHECKING:
    from sim_engine.engine import SimEngine

log = logging.getLogger("sim_engine.kv_transfer")

PULL_PATH = "/kv_transfer/pull"
HEARTBEAT_PATH = "/kv_transfer/heartbeat"
DEFAULT_MS_PER_1K_TOKENS = 5.0  # 128 KiB of KV per token (8B, bf16) at ~25 GB/s (NIXL over RDMA)
DEFAULT_TIMEOUT_S = 30.0  # vLLM 0.32's kv_lease_duration
HEARTBEATS_PER_LEASE = 6  # vLLM: a heartbeat every kv_lease_duration // 6 ...
LEASE_EXTENSION = 2 / 3  # ... extends the lease to kv_lease_duration * 2 // 3 from then
CONNECT_SLACK_S = 10.0  # a pull's HTTP time beyond its read
Transport = Callable[[RemotePrefill, list[int], float], Awaitable[list[int]]]


class TransferError(Exception):
    """A pull the prefill engine refused (it does not hold the blocks) or that read the wrong KV."""


@dataclass
class _Held:
    """A finished prefill leg's blocks, kept for a decode engine."""

    blocks: list[Block]
    tokens: list[int]  # the tokens whose KV they hold
    expires: float  # monotonic
    reading: bool = False  # a decode engine is reading them: freed when it is done


class KVConnector:
    """One engine's side of the transfers: the blocks it keeps as a prefill engine, the pulls and
    heartbeats it sends as a decode engine."""

    def __init__(
        self,
        ms_per_1k_tokens: float = DEFAULT_MS_PER_1K_TOKENS,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        speedup: float = 1.0,
        host: str = "localhost",
        engine_id: str | None = None,
    ) -> None:
        self.ms_per_1k_tokens = ms_per_1k_tokens
        self.timeout_s = timeout_s  # wall-clock, as the lease is: --speedup does not divide it
        self.speedup = speedup
        self.engine_id = engine_id or str(uuid.uuid4())  # vLLM's default engine_id
        self.host, self.port = host, 0  # where decode engines pull from (the port once HTTP listens)
        self.held: dict[str, _Held] = {}  # by the prefill leg's request id
        self.transport: Transport = self._http_pull  # tests may read from another connector directly
        self._engine: SimEngine | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._held_changed = asyncio.Event()

    def attach(self, engine: SimEngine) -> None:
        self._engine = engine

    @property
    def engine(self) -> SimEngine:
        assert self._engine is not None, "the connector is not attached to an engine"
        return self._engine

    def start(self) -> KVConnector:
        """Run the lease reaper and the heartbeats (in the running event loop)."""
        self._spawn(self._reap_loop())
        self._spawn(self._heartbeat_loop())
        return self

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- the prefill engine's side ------------------------------------------------------------

    def hold(self, request: SimRequest) -> dict[str, Any]:
        """Keep a finished prefill leg's blocks; its reply's ``kv_transfer_params``."""
        blocks, request.blocks, request.num_cached_blocks = request.blocks, [], 0
        computed = request.num_computed
        self.held[request.request_id] = _Held(blocks, request.all_tokens[:computed], time.monotonic() + self.timeout_s)
        self._held_changed.set()
        size = self.engine.pool.block_size
        params: dict[str, Any] = {  # vLLM's keys, in its order
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[b.block_id for b in blocks[: cdiv(computed, size)]]],  # per KV-cache group
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": computed,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
        }
        if len(request.output) == 1:  # vLLM adds it with the prefill stats, on the first output only
            params["remote_prefill_cached_tokens"] = request.cached_tokens or 0
        return params

    def claim(self, engine_id: str, request_id: str, block_ids: Iterable[int]) -> _Held:
        """The blocks a decode engine is about to read, kept until :meth:`release`."""
        self.reap()
        if engine_id != self.engine_id:
            raise TransferError(f"engine {engine_id} is not this one ({self.engine_id}): it restarted or never was")
        held = self.held.get(request_id)
        if held is None or held.reading:
            raise TransferError(
                f"no KV held for request {request_id}: unknown, already read, or its lease expired "
                f"(--kv-transfer-timeout-s {self.timeout_s:g})"
            )
        missing = set(block_ids) - {b.block_id for b in held.blocks}
        if missing:
            raise TransferError(f"request {request_id} holds no block {min(missing)}")
        held.reading = True
        return held

    def release(self, request_id: str) -> None:
        """Free a prefill leg's blocks (read, or its lease over), its tail first, as vLLM frees them."""
        held = self.held.pop(request_id, None)
        if held is not None:
            self.engine.pool.free(reversed(held.blocks))
            self.engine.wake()  # the room may admit a waiting request

    async def serve_pull(self, engine_id: str, request_id: str, block_ids: list[int], read_s: float) -> list[int]:
        """A decode engine's read: the tokens whose KV it got (the blocks are freed after it)."""
        held = self.claim(engine_id, request_id, block_ids)
        try:
            await asyncio.sleep(read_s)
        finally:
            self.release(request_id)
        return held.tokens

    def extend(self, request_ids: Iterable[str]) -> None:
        """A decode engine's heartbeat: it still holds requests for these blocks."""
        expires = time.monotonic() + self.timeout_s * LEASE_EXTENSION
        for request_id in request_ids:
            if (held := self.held.get(request_id)) is not None:
                held.expires = max(held.expires, expires)
        self._held_changed.set()

    def reap(self) -> None:
        now = time.monotonic()
        for request_id, held in list(self.held.items()):
            if not held.reading and held.expires <= now:
                log.warning("releasing expired KV blocks for request %s, never read by a decode engine", request_id)
                self.release(request_id)

    async def _reap_loop(self) -> None:
        while True:
            expiries = [h.expires for h in self.held.values() if not h.reading]
            delay = max(min(expiries) - time.monotonic(), 0.0) if expiries else None
            self._held_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._held_changed.wait(), delay)
            self.reap()

    # --- the decode engine's side -------------------------------------------------------------

    def pull(self, request: SimRequest, skip_blocks: int, tokens: int) -> None:
        """Start pulling an admitted decode leg's KV past its first ``skip_blocks`` (its local hit):
        ``tokens`` tokens, read at ``ms_per_1k_tokens``."""
        assert request.remote is not None
        request.remote.state = PULLING
        read_s = tokens * self.ms_per_1k_tokens / 1e6 / self.speedup
        self._spawn(self._pull(request, request.remote, request.remote.block_ids[skip_blocks:], read_s))

    async def _pull(self, request: SimRequest, remote: RemotePrefill, block_ids: list[int], read_s: float) -> None:
        try:
            tokens = await self.transport(remote, block_ids, read_s)
            if tokens[: len(request.prompt)] != request.prompt:
                raise TransferError(f"request {remote.request_id} of the prefill engine holds another prompt's KV")
        except (TransferError, aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            remote.state, remote.error = FAILED, str(exc) or type(exc).__name__
            log.warning("KV load failed for request %s: %s", request.request_id, remote.error)
        else:
            remote.state = PULLED
        self.engine.wake()

    def abandon(self, remote: RemotePrefill) -> None:
        """A decode leg aborted before it pulled: the prefill engine frees its blocks now (vLLM's
        worker sends the notification that ends a read, without reading)."""

        async def notify() -> None:
            with contextlib.suppress(TransferError, aiohttp.ClientError, OSError, TimeoutError, ValueError):
                await self.transport(remote, [], 0.0)

        self._spawn(notify())

    async def _http_pull(self, remote: RemotePrefill, block_ids: list[int], read_s: float) -> list[int]:
        body = {
            "remote_engine_id": remote.engine_id,
            "remote_request_id": remote.request_id,
            "remote_block_ids": block_ids,
            "read_s": read_s,
        }
        timeout = aiohttp.ClientTimeout(total=read_s + CONNECT_SLACK_S)
        async with self._client().post(_url(remote, PULL_PATH), json=body, timeout=timeout) as reply:
            answer = await reply.json(content_type=None)
        if reply.status != 200:
            raise TransferError(f"the prefill engine answered {reply.status}: {_message(answer)}")
        tokens = answer.get("token_ids") if isinstance(answer, dict) else None
        if not isinstance(tokens, list):
            raise TransferError("the prefill engine's answer has no token_ids")
        return tokens

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.timeout_s / HEARTBEATS_PER_LEASE)
            await self._heartbeats()

    async def _heartbeats(self) -> None:
        """Tell each prefill engine which of its requests this engine still holds, unpulled."""
        owed: dict[tuple[str, int, str], list[str]] = {}
        for request in (*self.engine.waiting, *self.engine.loading):
            remote = request.remote
            if remote is not None and remote.state in (UNREAD, PULLING) and not request.finished.is_set():
                owed.setdefault((remote.host, remote.port, remote.engine_id), []).append(remote.request_id)
        await asyncio.gather(*(self._heartbeat(*where, ids) for where, ids in owed.items()))

    async def _heartbeat(self, host: str, port: int, engine_id: str, request_ids: list[str]) -> None:
        url = _url(RemotePrefill(engine_id, "", [], host, port), HEARTBEAT_PATH)
        body = {"remote_engine_id": engine_id, "request_ids": request_ids}
        timeout = aiohttp.ClientTimeout(total=self.timeout_s / HEARTBEATS_PER_LEASE)
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):  # as vLLM: a lost one is logged only
            async with self._client().post(url, json=body, timeout=timeout) as reply:
                await reply.read()


def _url(remote: RemotePrefill, path: str) -> str:
    host = f"[{remote.host}]" if ":" in remote.host else remote.host
    return f"http://{host}:{remote.port}{path}"


def _message(answer: Any) -> str:
    error = answer.get("error") if isinstance(answer, dict) else None
    return str(error.get("message")) if isinstance(error, dict) else str(answer)
