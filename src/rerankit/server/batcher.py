"""Batching across requests: a fair queue of request chunks in front of the engine, one engine call at a time in a
worker thread (two on a GPU, pipelined: ``pipelined_calls``; one a replica, for a backend of ``data_parallel_size``
replicas). What goes into each call is ``scheduler.FairQueue``'s rule; this module decides when calls go. A
backend without ``score_batch`` (a remote server, ``rerankit serve --model http://...``) gets each request whole in
a call of its own, up to its ``max_concurrency`` calls at once, sent as soon as a call is free.

When. A request that finds the server idle (no engine call ended within the last ``batch_window_ms``) is sent at
once. While the server is busy, the next call waits for company: until every caller the last call answered has sent
again, the budget is full, or ``batch_window_ms`` has passed since the last call ended. Counting from the end of the
last call, not from a request's arrival, is what keeps calls large under load: a request that arrived while the
engine ran has always "waited out" a window counted from its arrival, so it went at once, alone or nearly alone.

Cancellation. A caller that goes away cancels its ``submit``: its chunks leave the queue, and an engine call whose
every request has gone stops before its next micro-batch (``should_stop``, where the backend takes it). A proxied
request (a backend with an ``async def ascore`` and no ``score_batch``) runs as a task on the event loop, cancelled
the moment its caller goes: its HTTP call to the far server is closed, not left to run out its deadline.

Shutdown. ``drain(seconds)`` refuses new work (``ShuttingDown``), lets queued and running work go on for
``seconds``, then answers everything left with ``ShuttingDown``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, TypeVar

from rerankit import tracing
from rerankit.backend import Backend
from rerankit.errors import Cancelled, Overloaded, RequestTooLarge, ShuttingDown
from rerankit.request_ids import REQUEST_ID
from rerankit.schema import ScoreRequest, ScoreResponse
from rerankit.server.limits import ServerConfig
from rerankit.server.metrics import Metrics
from rerankit.server.scheduler import (Chunk, FairQueue, Piece, Submission, estimate_tokens, item_tokens,
                                       power_of_two_floor, split)

__all__ = ["Batcher", "estimate_tokens", "score_each", "warm_up_shapes"]

log = logging.getLogger("rerankit.server")

T = TypeVar("T")

# A chunk is sized to about this much engine time, from the throughput the engine has shown: on an H100 that is the
# whole ``max_chunk_tokens``; on a CPU a few hundred tokens, so that a request arriving behind a large one waits for
# a fraction of a second, not for seconds of its chunk. Powers of two from MIN_CHUNK_TOKENS: a bounded set of sizes.
CHUNK_TARGET_S = 0.05
MIN_CHUNK_TOKENS = 256
# An engine call holds at most this many chunks' worth of tokens (and max_batch_tokens): ~0.8 s of engine time, so
# that a request arriving behind a full call of other requests' chunks does not wait for seconds of it on a CPU
# (an H100's calls stay at max_batch_tokens: 16 x 8,192 = 131,072).
CALL_CHUNKS = 16
RATE_DECAY = 0.8  # the throughput figure is the best recent one: small calls (launch-bound) do not drag it down
WARM_UP_ITEM_OVERHEAD = 8  # tokens of a warm-up pair that are not its item's words: query, template, specials
# Calls in flight for a backend without ``score_batch`` (a proxy: ``rerankit serve --model http://...``) that does
# not say its ``max_concurrency``: each call is one whole request, and the far server batches them itself.
PROXY_CALLS = 8


class Batcher:
    """Queue + dispatcher: ``await submit(request)`` resolves when the engine calls holding its chunks end."""

    def __init__(self, backend: Backend, config: ServerConfig) -> None:
        self.backend = backend
        self.config = config
        self._queue = FairQueue()
        self.metrics = Metrics(queue_depth=lambda: len(self._queue), queue_chunks=lambda: self._queue.chunks,
                               replicas=getattr(backend, "replica_status", None))  # data-parallel replicas
        self._arrived = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        # Engine threads: as many as the backend keeps busy. A model runs one call at a time, but on a GPU a call
        # lets go of it once its work is queued, so a second call plans and launches while the first one's kernels
        # finish and its scores come back (``pipelined_calls``: the GPU never waits for the host between calls). A
        # data-parallel backend takes as many calls at once as it has replicas, each on a replica of its own. A
        # backend without ``score_batch`` (a remote server) scores one request a call, so it gets several calls in
        # flight (its ``max_concurrency``), each a whole request: the remote client splits large ones itself.
        self._one_by_one = getattr(backend, "score_batch", None) is None
        if self._one_by_one:
            calls = max(1, int(getattr(backend, "max_concurrency", None) or PROXY_CALLS))
        else:
            calls = max(1, int(getattr(backend, "data_parallel_size", 1) or 1),
                        int(getattr(backend, "pipelined_calls", 1) or 1))
        self._engine_thread = ThreadPoolExecutor(max_workers=calls, thread_name_prefix="rerankit-engine")
        self._free_calls = asyncio.Semaphore(calls)
        self._calls: set[asyncio.Task] = set()  # engine calls running
        self._dispatcher: asyncio.Task | None = None
        self._live: set[Submission] = set()  # submitted and not answered yet, queued or running
        self._last_end = -math.inf  # loop time the last engine call ended
        self._last_requests = 0  # requests the last call answered
        self._arrivals_since_end = 0
        self.refusing = asyncio.Event()  # set once draining: new requests, and bodies still arriving, get a 503
        self._abort = False  # read by the engine thread: drop the running call at its next micro-batch
        # Budgets bucketed to powers of two, so that the calls the queue forms come in a bounded set of sizes.
        self.max_chunk_tokens = power_of_two_floor(min(config.max_chunk_tokens, config.max_batch_tokens))
        self._tokens_per_s: float | None = None  # the engine's recent best, from the calls' estimated tokens
        self.item_cap = getattr(backend, "max_length", None)  # the model's longest input, where the backend says
        self._takes_should_stop = _accepts(getattr(backend, "score_batch", None), "should_stop")
        # A proxy with a coroutine ``ascore`` is awaited on the loop (cancellable); one without, on a thread.
        self._awaits_backend = self._one_by_one and inspect.iscoroutinefunction(getattr(backend, "ascore", None))

    @property
    def proxies(self) -> bool:
        """Whether the backend forwards whole requests to another server (no ``score_batch``): that server cuts
        items by its own limits."""
        return self._one_by_one

    @property
    def chunk_tokens(self) -> int:
        """The token budget of the chunks new requests are cut into: ``CHUNK_TARGET_S`` of engine time, a power of
        two from ``MIN_CHUNK_TOKENS`` up to ``max_chunk_tokens`` (the most, before the engine's speed is known)."""
        if self._tokens_per_s is None:
            return self.max_chunk_tokens
        fitting = power_of_two_floor(int(self._tokens_per_s * CHUNK_TARGET_S))
        return min(self.max_chunk_tokens, max(MIN_CHUNK_TOKENS, fitting))

    @property
    def call_tokens(self) -> int:
        """The token budget of one engine call: ``max_batch_tokens``, or ``CALL_CHUNKS`` chunks if that is less."""
        return min(self.config.max_batch_tokens, CALL_CHUNKS * self.chunk_tokens)

    @property
    def queue_depth(self) -> int:
        """Requests with chunks waiting for an engine call (not counting chunks running)."""
        return len(self._queue)

    async def warm_up(self) -> None:
        """Run the backend's ``warm_up()`` (if it has one) on the engine thread, over every shape of call this batcher
        can form (``warm_up_shapes``) where it takes them; a failure is logged, not raised: the server still starts,
        and a real request meets the error itself."""
        warm_up = getattr(self.backend, "warm_up", None)
        if warm_up is None:
            return
        shapes = warm_up_shapes(self.config)
        call = (lambda: warm_up(shapes=shapes)) if _accepts(warm_up, "shapes") else warm_up
        log.info("warming up the engine over %d call shapes (compiling, capturing CUDA graphs)...", len(shapes))
        try:
            seconds = await asyncio.get_running_loop().run_in_executor(self._engine_thread, call)
        except Exception as exc:  # noqa: BLE001 - the server serves on; requests will report the problem
            log.warning("the engine's warm-up failed: %r", exc)
            return
        log.info("engine warmed up in %.1f s", seconds)

    def start(self) -> None:
        """Start the dispatcher on the running event loop."""
        self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch_forever())

    async def stop(self) -> None:
        """Stop the dispatcher; whatever is still queued or running is answered ``ShuttingDown``."""
        self.refusing.set()
        self._abort = True
        for task in (self._dispatcher, *self._calls):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._fail_everything(ShuttingDown("the server is shutting down"))
        await asyncio.to_thread(self._engine_thread.shutdown, wait=True)  # the loop serves on while a call ends

    async def drain(self, seconds: float) -> None:
        """Refuse new work from now on; give queued and running work ``seconds`` to finish, then answer the rest
        ``ShuttingDown`` (the running engine call stops at its next micro-batch where the backend allows it)."""
        self.refusing.set()
        log.info("draining: %d requests in progress; %.1f s to finish", len(self._live), seconds)
        try:
            await asyncio.wait_for(self._idle.wait(), seconds)
        except asyncio.TimeoutError:
            self._abort = True
            self._fail_everything(ShuttingDown(f"the server is shutting down; the work was not done within the "
                                               f"drain time of {seconds:g} s (drain_seconds)"))

    def admit(self) -> None:
        """Raise ``ShuttingDown`` (503) once draining, ``Overloaded`` (429) when the queue is full and no queued
        request of a priority above 0 could make room (the route asks before it reads a body, not knowing its
        priority yet; ``submit`` decides once it has it)."""
        self._refuse_if_draining()
        if len(self._queue) >= self.config.max_queue_requests and self._queue.sheddable() is None:
            raise self._full()

    def _refuse_if_draining(self) -> None:
        if self.refusing.is_set():
            raise ShuttingDown("the server is shutting down and takes no new requests")

    def _full(self) -> Overloaded:
        return Overloaded(f"the queue holds {len(self._queue)} requests; the limit is "
                          f"{self.config.max_queue_requests} (max_queue_requests)")

    def _make_room(self, priority: int) -> None:
        """Under ``max_queue_requests``, or with room made: the sheddable request of the lowest priority (a higher
        number than ``priority``, none of its chunks run yet) answered 429; else ``Overloaded`` for the newcomer.
        So under overload, batch work at priority 5 goes before interactive work at 0 is refused."""
        if len(self._queue) < self.config.max_queue_requests:
            return
        victim = self._queue.sheddable(priority)
        if victim is None:
            raise self._full()
        self._queue.remove(victim)
        victim.future.set_exception(Overloaded(
            f"the queue was full (max_queue_requests={self.config.max_queue_requests}) and a request of a lower "
            f"priority number ({priority}, against this one's {victim.priority}) took this one's place"))
        self.metrics.shed += 1

    async def submit(self, request: ScoreRequest, caller: str = "") -> ScoreResponse:
        """Queue ``request`` and wait for its response. ``ShuttingDown`` (503) once draining, ``RequestTooLarge``
        (413) over ``max_request_tokens``, ``Overloaded`` (429) when the queue is full. Cancelling the call (its
        caller went away) takes its chunks out of the queue. The request's ``priority``: lower goes first, and under a
        full queue takes the place of a queued request of a higher number (``_make_room``); ``caller``: whose it is,
        for the fair shares (``scheduler.FairQueue``)."""
        self._refuse_if_draining()
        tokens = item_tokens(request, self.item_cap)
        total = sum(tokens)
        if total > self.config.max_request_tokens:
            raise RequestTooLarge("items", f"hold about {total} tokens after truncation; the limit is "
                                  f"{self.config.max_request_tokens} (max_request_tokens)",
                                  self.config.max_request_tokens)
        self._make_room(request.priority)
        future = asyncio.get_running_loop().create_future()
        chunks = ([Chunk(0, len(tokens), total)] if self._one_by_one
                  else split(tokens, self.chunk_tokens, self.config.max_batch_items))
        # submit runs in the route's context: its request id and trace
        submission = Submission(request, chunks, future, REQUEST_ID.get(), tracing.current_context(), caller)
        self._queue.add(submission)
        self._live.add(submission)
        future.add_done_callback(lambda _: self._live.discard(submission))
        self._idle.clear()
        self._arrivals_since_end += 1
        self._arrived.set()
        try:
            return await future
        except asyncio.CancelledError:  # counted by the route, which knows why
            self._queue.remove(submission)
            raise
        finally:
            _record_spans(submission, len(chunks))

    async def _dispatch_forever(self) -> None:
        while True:
            while not self._queue:
                if not self._calls:
                    self._idle.set()
                self._arrived.clear()
                await self._arrived.wait()
            await self._free_calls.acquire()  # an engine thread (a replica) is free
            if self.config.batching and not self._one_by_one:
                await self._wait_for_company()
            budget = (self.config.max_batch_items, self.call_tokens)
            one = self._one_by_one or not self.config.batching
            pieces = self._queue.take(*budget, max_requests=1 if one else None)
            if not pieces:
                self._free_calls.release()
            else:
                call = asyncio.get_running_loop().create_task(self._run(pieces))
                self._calls.add(call)
                call.add_done_callback(self._call_done)

    def _call_done(self, call: asyncio.Task) -> None:
        """An engine call ended: its thread (replica) is free, and the server idle if nothing else is left."""
        self._calls.discard(call)
        self._free_calls.release()
        if not self._calls and not self._queue:
            self._idle.set()
        self._arrived.set()  # wake the dispatcher: it may wait for a free replica's turn or an empty queue

    async def _wait_for_company(self) -> None:
        """While busy: until the last call's callers have all sent again, the budget is full, or the window ends."""
        loop = asyncio.get_running_loop()
        deadline = self._last_end + self.config.batch_window_ms / 1000
        held = False
        while (loop.time() < deadline and self._arrivals_since_end < self._last_requests
               and not self._queue.holds_at_least(self.config.max_batch_items, self.call_tokens)):
            held = True
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                break
        self.metrics.held_calls += held

    async def _run(self, pieces: list[Piece]) -> None:
        """One engine call over ``pieces``; whatever goes wrong fails its pieces' requests, never the dispatcher."""
        try:
            await self._call(pieces)
        except Exception as exc:  # noqa: BLE001 - a bug or a broken backend: this call's callers get a 500
            log.exception("an engine call of %d requests failed (request ids: %s)", len(pieces), _ids(pieces))
            for piece in pieces:
                if not piece.submission.gone:
                    piece.submission.future.set_exception(exc)
                self._queue.remove(piece.submission)

    async def _call(self, pieces: list[Piece]) -> None:
        requests = [piece.request() for piece in pieces]
        # A proxy honours priority in its own queue and sends 0 on: vLLM refuses any other value unless it was
        # started with priority scheduling.
        if self._one_by_one:
            requests = [request.model_copy(update={"priority": 0}) for request in requests]
        self.metrics.observe_batch(len(requests), sum(len(request.items) for request in requests))

        def should_stop() -> bool:  # runs on the engine thread; reads flags the loop's thread sets
            return self._abort or all(piece.submission.gone for piece in pieces)

        loop = asyncio.get_running_loop()
        begun = loop.time()
        try:
            if self._awaits_backend:
                outcomes = list(await asyncio.gather(*(self._ascore(piece, request)
                                                       for piece, request in zip(pieces, requests))))
            else:
                outcomes = await loop.run_in_executor(self._engine_thread, score_each, self.backend, requests,
                                                      should_stop if self._takes_should_stop else None)
            if len(outcomes) != len(pieces):  # answered by position: a piece without its own outcome never returns
                error = RuntimeError(f"the engine returned {len(outcomes)} outcomes for {len(pieces)} requests")
                log.error("%s (request ids: %s)", error, _ids(pieces))
                outcomes = [error] * len(pieces)
            # The speed of the work done: a piece that failed at once (refused, or before the engine ran) adds
            # tokens but no time, and would make the engine look far faster than it is.
            scored = [piece.chunk.tokens for piece, outcome in zip(pieces, outcomes)
                      if isinstance(outcome, ScoreResponse)]
            if scored:
                self._observe_speed(sum(scored), loop.time() - begun)
        except Cancelled as stopped:
            outcomes = [stopped] * len(pieces)
        finally:
            self._arrivals_since_end = 0
            self._last_end = loop.time()
        answered = 0
        for piece, outcome in zip(pieces, outcomes):
            pending = not piece.submission.gone
            piece.submission.deliver(piece.chunk, outcome)
            answered += pending and piece.submission.gone
            if isinstance(outcome, BaseException):
                self._queue.remove(piece.submission)
        # Only callers answered now may send again soon: a call of a large request's chunk answers nobody, and the
        # next call waits for no one (it would only idle the engine for the window).
        self._last_requests = answered
        if len(pieces) and all(isinstance(outcome, Cancelled) for outcome in outcomes):
            self.metrics.stopped_calls += 1

    async def _ascore(self, piece: Piece, request: ScoreRequest) -> ScoreResponse | Exception:
        """``request`` through the backend's ``ascore`` as a task of its own, cancelled as soon as the piece's
        caller has gone (cancelled, or failed by a drain that gave up): ``Cancelled`` then, the error it raised
        otherwise. Cancelling this call itself (``stop``) cancels the task too. The task runs under the caller's
        request id (``REQUEST_ID``) and trace context, which a proxy's remote client forwards: each ``ascore``
        serves one caller."""
        scoring = asyncio.ensure_future(_as_caller(piece.submission, self.backend.ascore(request)))

        def caller_gone(_: asyncio.Future) -> None:
            scoring.cancel()

        piece.submission.future.add_done_callback(caller_gone)
        try:
            return await scoring
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not scoring.cancelled() or (current is not None and current.cancelling()):
                raise
            return Cancelled("the caller went away; its request to the backend was cancelled")
        except Exception as exc:  # noqa: BLE001 - handed to the request's caller, who maps it to a status
            return exc
        finally:
            piece.submission.future.remove_done_callback(caller_gone)

    def _observe_speed(self, tokens: int, seconds: float) -> None:
        rate = tokens / max(seconds, 1e-6)
        self._tokens_per_s = rate if self._tokens_per_s is None else max(rate, self._tokens_per_s * RATE_DECAY)

    def _fail_everything(self, error: Exception) -> None:
        self._queue.drain()
        for submission in list(self._live):
            if not submission.gone:
                submission.future.set_exception(error)
        self._idle.set()


def _ids(pieces: list[Piece]) -> str:
    """The request ids of an engine call's pieces, for its log lines."""
    return ", ".join(dict.fromkeys(str(piece.submission.request_id) for piece in pieces))


async def _as_caller(submission: Submission, work: Awaitable[T]) -> T:
    """``work``'s result, awaited under ``submission``'s request id (``REQUEST_ID``) and trace context, in the task's
    own copy of the context (the batcher's, not the caller's, as the dispatcher creates the task)."""
    REQUEST_ID.set(submission.request_id)
    with tracing.attached(submission.trace_context):
        return await work


def _record_spans(submission: Submission, chunks: int) -> None:
    """The request's time queued and time scored as child spans of its server span (where one records)."""
    if not tracing.recording():
        return
    started = submission.started_ns
    tracing.record_span("rerankit.queue", submission.queued_ns, started, chunks=chunks)
    if started is not None:
        tracing.record_span("rerankit.engine", started, None, chunks=chunks, engine_calls=submission.calls)


def score_each(backend: Backend, requests: list[ScoreRequest],
               should_stop: Callable[[], bool] | None = None) -> list[ScoreResponse | Exception]:
    """Score ``requests`` in one engine call where the backend can (``score_batch``), one by one otherwise.

    A request the engine refuses (a token id out of the vocabulary, an item too long) gets its own error back
    and the others their scores. When the merged call fails as a whole (out of memory), each request is
    scored alone, so that only the requests that fail alone fail; a ``Cancelled`` call is not retried.
    """
    options = {} if should_stop is None else {"should_stop": should_stop}
    score_batch = getattr(backend, "score_batch", None)
    if score_batch is not None and len(requests) > 1:
        try:
            return list(score_batch(requests, return_exceptions=True, **options))
        except Cancelled:
            raise
        except Exception as exc:  # noqa: BLE001 - retried one by one below, where each request meets its own error
            log.warning("an engine call of %d requests failed (%r); scoring them one by one", len(requests), exc)
    outcomes: list[ScoreResponse | Exception] = []
    for request in requests:
        if should_stop is not None and should_stop():
            raise Cancelled("every caller of this engine call went away")
        try:
            outcomes.append(score_batch([request], **options)[0] if score_batch is not None and options
                            else backend.score(request))
        except Cancelled:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the request's caller, who maps it to a status
            outcomes.append(exc)
    return outcomes


def warm_up_shapes(config: ServerConfig) -> list[tuple[int, int]]:
    """The (items, words per item) of the synthetic requests that warm the engine up: one of about ``t`` tokens for
    each power of two ``t`` from 256 up to the call budget (a chunk's budget is never larger),
    so that every token bucket a call of this batcher can reach is compiled, and captured where it replays from a
    CUDA graph, before the server says it is ready. Items of ~64 tokens (``WARM_UP_ITEM_OVERHEAD`` of them the
    query and template), as many as the item budget takes; longer items past it."""
    shapes, tokens = [], 256
    while tokens <= power_of_two_floor(config.max_batch_tokens):
        items = max(1, min(config.max_batch_items, tokens // 64))
        shapes.append((items, max(1, tokens // items - WARM_UP_ITEM_OVERHEAD)))
        tokens *= 2
    return shapes


def _accepts(function: Callable | None, name: str) -> bool:
    """Whether ``function`` takes a keyword ``name`` (other backends may not: it is passed only where taken)."""
    if function is None:
        return False
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
