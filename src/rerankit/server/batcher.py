"""Batching across requests: one queue in front of the engine, one engine call per batch, in a worker thread.

Policy. A request that finds the engine idle and the queue empty is sent at once: an idle server never holds
a request back. Requests that arrive while the engine runs wait in the queue and go together in the next
call, up to the budget (items, estimated tokens). When the engine frees up, the next call waits until its
oldest request has been queued ``batch_window_ms`` (or the budget is full): the callers answered by the call
that just ended send again within a few ms, and so join this call instead of forming a call of their own.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rerankit.backend import Backend
from rerankit.errors import Overloaded
from rerankit.schema import ScoreRequest, ScoreResponse
from rerankit.server.limits import ServerConfig
from rerankit.server.metrics import Metrics

log = logging.getLogger("rerankit.server")

BYTES_PER_TOKEN = 4  # the server does not tokenize: text items are budgeted at about 4 UTF-8 bytes a token


def estimate_tokens(request: ScoreRequest) -> int:
    """About how many tokens scoring ``request`` feeds the model (exact for token ids), for the batch budget."""
    def length(part: str | list[int]) -> int:
        return len(part) if isinstance(part, list) else max(1, len(part.encode()) // BYTES_PER_TOKEN)

    cap = request.max_tokens_per_item
    query = length(request.query)
    return sum(query + (length(item) if cap is None else min(cap, length(item))) for item in request.items)


@dataclass
class _Pending:
    request: ScoreRequest
    future: asyncio.Future
    tokens: int
    arrived: float  # loop time
    found_idle: bool  # the engine was idle and the queue empty when it arrived


class Batcher:
    """Queue + dispatcher: ``await submit(request)`` resolves when the engine call holding it ends."""

    def __init__(self, backend: Backend, config: ServerConfig) -> None:
        self.backend = backend
        self.config = config
        self._queue: deque[_Pending] = deque()
        self.metrics = Metrics(queue_depth=lambda: len(self._queue))
        self._arrived = asyncio.Event()
        # One engine thread: a model runs one call at a time; more threads would only contend for it.
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rerankit-engine")
        self._running = False
        self._dispatcher: asyncio.Task | None = None

    @property
    def queue_depth(self) -> int:
        """Requests waiting for an engine call (not counting the one running)."""
        return len(self._queue)

    async def warm_up(self) -> None:
        """Run the backend's ``warm_up()`` (if it has one) on the engine thread; a failure is logged, not raised:
        the server still starts, and a real request meets the error itself."""
        warm_up = getattr(self.backend, "warm_up", None)
        if warm_up is None:
            return
        log.info("warming up the engine (compiling, capturing CUDA graphs)...")
        try:
            seconds = await asyncio.get_running_loop().run_in_executor(self._engine_thread, warm_up)
        except Exception as exc:  # noqa: BLE001 - the server serves on; requests will report the problem
            log.warning("the engine's warm-up failed: %r", exc)
            return
        log.info("engine warmed up in %.1f s", seconds)

    def start(self) -> None:
        """Start the dispatcher on the running event loop."""
        self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch_forever())

    async def stop(self) -> None:
        """Stop the dispatcher; requests still queued fail with ``Overloaded``."""
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            try:
                await self._dispatcher
            except asyncio.CancelledError:
                pass
        while self._queue:
            pending = self._queue.popleft()
            if not pending.future.done():
                pending.future.set_exception(Overloaded("the server is shutting down"))
        self._engine_thread.shutdown(wait=True)

    async def submit(self, request: ScoreRequest) -> ScoreResponse:
        """Queue ``request`` and wait for its response; ``Overloaded`` (429) when the queue is full."""
        if len(self._queue) >= self.config.max_queue_requests:
            raise Overloaded(f"the queue holds {len(self._queue)} requests; the limit is "
                             f"{self.config.max_queue_requests} (max_queue_requests)")
        loop = asyncio.get_running_loop()
        pending = _Pending(request, loop.create_future(), estimate_tokens(request), loop.time(),
                           found_idle=not self._running and not self._queue)
        self._queue.append(pending)
        self._arrived.set()
        return await pending.future

    async def _dispatch_forever(self) -> None:
        while True:
            while not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            oldest = self._queue[0]
            if self.config.batching and not oldest.found_idle:
                await self._collect_until(oldest.arrived + self.config.batch_window_ms / 1000)
            batch = self._take_batch()
            if batch:
                self._running = True
                try:
                    await self._run(batch)
                finally:
                    self._running = False

    async def _collect_until(self, deadline: float) -> None:
        """Wait for more requests until ``deadline`` (loop time) or until the budget is full."""
        loop = asyncio.get_running_loop()
        while not self._budget_full() and loop.time() < deadline:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                return

    def _budget_full(self) -> bool:
        items = sum(len(pending.request.items) for pending in self._queue)
        tokens = sum(pending.tokens for pending in self._queue)
        return items >= self.config.max_batch_items or tokens >= self.config.max_batch_tokens

    def _take_batch(self) -> list[_Pending]:
        """The queue's head up to the budget; a request over the budget on its own still goes, alone."""
        batch: list[_Pending] = []
        items = tokens = 0
        while self._queue:
            head = self._queue[0]
            if head.future.done():  # its caller went away
                self._queue.popleft()
                continue
            fits = (items + len(head.request.items) <= self.config.max_batch_items
                    and tokens + head.tokens <= self.config.max_batch_tokens)
            if batch and (not fits or not self.config.batching):
                break
            batch.append(self._queue.popleft())
            items += len(head.request.items)
            tokens += head.tokens
        return batch

    async def _run(self, batch: list[_Pending]) -> None:
        requests = [pending.request for pending in batch]
        self.metrics.observe_batch(len(requests), sum(len(request.items) for request in requests))
        loop = asyncio.get_running_loop()
        try:
            outcomes = await loop.run_in_executor(self._engine_thread, score_each, self.backend, requests)
            for pending, outcome in zip(batch, outcomes):
                if pending.future.done():
                    continue
                if isinstance(outcome, BaseException):
                    pending.future.set_exception(outcome)
                else:
                    pending.future.set_result(outcome)
        finally:  # stopped mid-call: its callers must not wait forever
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(Overloaded("the server is shutting down"))


def score_each(backend: Backend, requests: list[ScoreRequest]) -> list[ScoreResponse | Exception]:
    """Score ``requests`` in one engine call where the backend can (``score_batch``), one by one otherwise.

    A request the engine refuses (a token id out of the vocabulary, an item too long) gets its own error back
    and the others their scores. When the merged call fails as a whole (out of memory), each request is
    scored alone, so that only the requests that fail alone fail.
    """
    score_batch = getattr(backend, "score_batch", None)
    if score_batch is not None and len(requests) > 1:
        try:
            return list(score_batch(requests, return_exceptions=True))
        except Exception as exc:  # noqa: BLE001 - retried one by one below, where each request meets its own error
            log.warning("an engine call of %d requests failed (%r); scoring them one by one", len(requests), exc)
    outcomes: list[ScoreResponse | Exception] = []
    for request in requests:
        try:
            outcomes.append(backend.score(request))
        except Exception as exc:  # noqa: BLE001 - handed to the request's caller, who maps it to a status
            outcomes.append(exc)
    return outcomes
