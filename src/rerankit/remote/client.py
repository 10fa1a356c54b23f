"""The remote backend's transport: pooled httpx clients, retries with backoff, a concurrency limit and
several endpoints with failover, all within one deadline per call. It moves JSON bodies, read under a size cap;
what they mean is the dialects' business.

The sync and async paths share every decision (``Attempts``, ``_failure_of_*``); only the I/O differs.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import random
import threading
import time
import weakref
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, ContextManager, Sequence

import httpx

from rerankit import tracing
from rerankit.errors import InvalidRequest
from rerankit.remote.attempts import Attempts, expired_error, failure_of_answer, failure_of_exception
from rerankit.remote.closing import Calls, Stop
from rerankit.remote.deadline import Deadline, Window, held_to, hold_sockets, stopped_by
from rerankit.remote.endpoints import Endpoints
from rerankit.remote.reply import ACCEPT_ENCODING, Answer, CappedBody, Reply, parse_json, probe_reply
from rerankit.request_ids import HEADER, REQUEST_ID, usable_request_id


# A call's default bound: room for one slow try (the default read timeout) and a failover to another endpoint;
# past two minutes a caller (a search request, a RAG step) is better served by an error than by more waiting.
DEFAULT_DEADLINE = 120.0
# Rerank replies are ~100 bytes an item; 64 MiB holds 1,000 items with a 4,096-float hidden state each.
DEFAULT_MAX_RESPONSE_BYTES = 64 * 2**20
# How long past the deadline a split call waits for its requests' own errors: those of the requests that were
# sending, not waiting for a slot, name the endpoints tried and what went wrong there.
_GRACE = 0.25


# The longest wait a setting may ask for (~11.6 days): the platform's timers overflow past ~9e9 s, and a longer
# bound is no bound (deadline=None says so).
MAX_SECONDS = 1e6


def check_seconds(name: str, value: Any, zero: bool = False, none: str = "") -> None:
    """``InvalidRequest`` naming ``name`` unless ``value`` is a number of seconds: > 0 (>= 0 with ``zero``), at
    most ``MAX_SECONDS``."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not (0 <= value if zero else 0 < value) or not value <= MAX_SECONDS:
        raise InvalidRequest(name, f"must be a number of seconds {'>= 0' if zero else '> 0'} and at most "
                                   f"{MAX_SECONDS:,.0f}{none}, got {value!r}")


def check_count(name: str, value: Any, low: int) -> None:
    """``InvalidRequest`` naming ``name`` unless ``value`` is a whole number >= ``low``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise InvalidRequest(name, f"must be a whole number >= {low}, got {value!r}")


@dataclass(frozen=True)
class Timeout:
    """Seconds to open a connection (``connect``), and for one try's whole answer, connection included (``read``)."""

    connect: float = 5.0
    read: float = 60.0

    def __post_init__(self) -> None:
        for name in ("connect", "read"):
            check_seconds(f"timeout.{name}", getattr(self, name))


@dataclass(frozen=True)
class ClientConfig:
    """How the transport retries, waits and limits itself.

    ``deadline`` bounds a whole call (every try, wait and endpoint; None: only each try's ``timeout``).
    Retries go to connect errors, timeouts, broken responses, 429 and 5xx, never to other 4xx; so do the rounds of
    discovery probes made while a server starts (``rerankit.remote.discover``).
    The n-th retry waits ``backoff_base * 2**(n-1)`` seconds with jitter (or the server's ``Retry-After``),
    at most ``backoff_max``; a retry that fails over to a live endpoint not yet tried does not wait, and a retry
    whose wait would outlast the deadline is not made.
    An endpoint that refuses connections or times out sits out ``dead_cooldown`` seconds, doubled each time it
    fails again on its return (up to 8x). A reply longer than ``max_response_bytes`` (decoded) is refused.
    """

    timeout: Timeout = field(default_factory=Timeout)
    max_retries: int = 3
    backoff_base: float = 0.25
    backoff_max: float = 10.0
    max_concurrency: int = 8
    dead_cooldown: float = 30.0
    deadline: float | None = DEFAULT_DEADLINE
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.timeout, Timeout):
            raise InvalidRequest("timeout", f"must be a Timeout or seconds, got {self.timeout!r}")
        check_count("max_retries", self.max_retries, 0)
        for name in ("backoff_base", "backoff_max", "dead_cooldown"):
            check_seconds(name, getattr(self, name), zero=True)
        for name in ("max_concurrency", "max_response_bytes"):
            check_count(name, getattr(self, name), 1)
        if self.deadline is not None:
            check_seconds("deadline", self.deadline, none="; None for no bound")

    def backoff(self, retry: int, retry_after: float | None) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        if retry_after is not None:
            return min(retry_after, self.backoff_max)
        return min(self.backoff_max, self.backoff_base * 2 ** (retry - 1)) * random.uniform(0.5, 1.0)


def _first_error(jobs: Sequence[Future[Any] | asyncio.Future[Any]]) -> BaseException | None:
    """The error of the first failed job in the bodies' order (of requests failing together, the one sent first)."""
    for job in jobs:
        if job.done() and not job.cancelled() and job.exception() is not None:
            return job.exception()
    return None


@dataclass
class _LoopClient:
    """The async client and slots of one event loop (httpx connections belong to the loop that made them)."""

    loop: asyncio.AbstractEventLoop
    client: httpx.AsyncClient
    slots: asyncio.Semaphore
    closer: Any = None  # the async generator that closes the client when its loop shuts down (``_closes_with_loop``)


class Transport:
    """Posts JSON bodies to a set of endpoints, sync or async, with retries, failover and a concurrency limit.

    Every call is bounded by a ``Deadline`` (the config's unless given), each try by ``timeout.read``. Each request
    carries the caller's ``rerankit.request_ids.REQUEST_ID``, where set, as its ``X-Request-Id``, and each try is a
    client span whose trace context goes with it (``rerankit.tracing``; where OpenTelemetry is installed).
    ``transport``: an httpx transport for both clients (``httpx.MockTransport`` in tests).
    """

    def __init__(self, urls: Sequence[str], config: ClientConfig | None = None, api_key: str | None = None,
                 transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config or ClientConfig()
        self.endpoints = Endpoints(urls, self.config.dead_cooldown)
        self._headers = {"Accept-Encoding": ACCEPT_ENCODING}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._transport = transport
        self._calls = Calls()  # the calls running (``stoppable``), which close() stops; once closed, none begins
        self._fresh_state()
        _LIVE_TRANSPORTS.add(self)

    def _fresh_state(self) -> None:
        """Pools, threads, slots and locks made anew: at the start, and in a forked child (``_after_fork_in_child``),
        where the parent's are not this process's to use: its pooled keep-alive sockets are shared with the parent
        (two processes reading one socket get each other's replies), its worker threads were not copied, and its
        lock may have been held by another thread."""
        self._slots = threading.BoundedSemaphore(self.config.max_concurrency)
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None
        self._executor: ThreadPoolExecutor | None = None
        # One async client per event loop: loops in several threads (asyncio.run in worker threads) each keep
        # theirs, rather than taking turns replacing one (a new client, and connections, on every switch).
        self._loop_clients: dict[asyncio.AbstractEventLoop, _LoopClient] = {}
        self._calls = Calls(self._calls.closed)  # a closed transport stays closed

    @property
    def closed(self) -> bool:
        """Whether ``close`` has run: no call begins any more."""
        return self._calls.closed

    @property
    def _no_slot(self) -> str:
        return f"waiting for one of the max_concurrency={self.config.max_concurrency} request slots"

    def deadline(self) -> Deadline:
        """A fresh deadline for one call, per the config."""
        return Deadline(self.config.deadline)

    def _limits(self) -> httpx.Limits:
        limit = self.config.max_concurrency
        return httpx.Limits(max_connections=limit, max_keepalive_connections=limit)

    def _sync_client(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                self._calls.check_open()  # no pool is opened after close(): nothing would close it
                transport = self._transport if isinstance(self._transport, httpx.BaseTransport) else None
                self._client = hold_sockets(httpx.Client(transport=transport, headers=self._headers,
                                                         limits=self._limits()))
            return self._client

    def _async_client(self) -> _LoopClient:
        loop = asyncio.get_running_loop()
        with self._lock:
            loop_client = self._loop_clients.get(loop)
            if loop_client is None:
                self._calls.check_open()
                # A client made under another loop cannot be used from this one; those of finished loops are
                # forgotten (their loop closed the client as it shut down: ``_closes_with_loop``).
                for done in [other for other in self._loop_clients if other.is_closed()]:
                    del self._loop_clients[done]
                transport = self._transport if isinstance(self._transport, httpx.AsyncBaseTransport) else None
                client = httpx.AsyncClient(transport=transport, headers=self._headers, limits=self._limits())
                loop_client = self._loop_clients[loop] = _LoopClient(
                    loop, client, asyncio.Semaphore(self.config.max_concurrency), _closes_with_loop(client))
                # Run it to its yield: asyncio.run (and any loop that calls shutdown_asyncgens) then closes the
                # client's connections before the loop ends; each asyncio.run(...ascore) used to leave them open.
                loop.create_task(_started(loop_client.closer))
            return loop_client

    def probe_client(self, seconds: float) -> httpx.AsyncClient:
        """A one-off async client with this transport's headers, outside its pool (busy requests cannot hold up a
        health probe), each step bounded by ``seconds``."""
        transport = self._transport if isinstance(self._transport, httpx.AsyncBaseTransport) else None
        return httpx.AsyncClient(transport=transport, headers=self._headers, timeout=seconds)

    def _request(self, client: httpx.Client | httpx.AsyncClient, method: str, url: str, body: Any,
                 window: Window) -> httpx.Request:
        left = window.left()
        timeout = httpx.Timeout(left, connect=min(self.config.timeout.connect, left))
        request_id = usable_request_id(REQUEST_ID.get())  # the request served (rerankit serve's, or the caller's)
        headers = {HEADER: request_id} if request_id else {}
        tracing.inject(headers)  # the try's client span (current here) as the far server's parent
        return client.build_request(method, url, json=body, timeout=timeout, headers=headers or None)

    def _exchange(self, method: str, url: str, body: Any, window: Window) -> Answer:
        """One sync request, its body streamed under the size cap, all within ``window``."""
        client = self._sync_client()
        with held_to(window), tracing.client_span(method, url) as traced:
            response = client.send(self._request(client, method, url, body, window), stream=True)
            traced.status(response.status_code)
            try:
                reader = CappedBody(response, self.config.max_response_bytes)
                for chunk in [response.content] if reader.read else response.iter_raw():
                    reader.add(chunk)
            finally:
                response.close()
        return reader.answer()

    async def _aexchange(self, method: str, url: str, body: Any, window: Window) -> Answer:
        """Async twin of ``_exchange``."""
        # wait_for, not asyncio.timeout: Python 3.10 has only the former.
        return await asyncio.wait_for(self._aread(method, url, body, window), window.left())

    async def _aread(self, method: str, url: str, body: Any, window: Window) -> Answer:
        client = self._async_client().client
        with tracing.client_span(method, url) as traced:
            response = await client.send(self._request(client, method, url, body, window), stream=True)
            traced.status(response.status_code)
            try:
                reader = CappedBody(response, self.config.max_response_bytes)
                if reader.read:
                    reader.add(response.content)
                else:
                    async for chunk in response.aiter_raw():
                        reader.add(chunk)
            finally:
                await response.aclose()
        return reader.answer()

    def post(self, path: str, body: Any, deadline: Deadline | None = None, stop: Stop | None = None) -> Any:
        """POST ``body`` to ``path`` of an endpoint, retrying per the config within ``deadline``; the JSON answer.

        ``stop``: once set, no further try is made (and a wait between tries ends): the call raises ``Cancelled``.
        """
        deadline = deadline or self.deadline()
        attempts = Attempts(self.endpoints, self.config, deadline, path)
        while True:
            if stop is not None:
                stop.check(_stopped(path))
            # The try's time starts once it has a slot: queueing behind our own requests is no fault of the server.
            if not self._slots.acquire(timeout=deadline.wait_limit()):
                raise attempts.expired(self._no_slot)
            try:
                window = attempts.window()
                with stopped_by(stop):
                    failure = failure_of_answer(answer := self._exchange("POST", attempts.url, body, window))
            except httpx.RequestError as exc:
                failure = failure_of_exception(exc, window)
            finally:
                self._slots.release()
            if failure is None:
                attempts.succeeded()
                return parse_json(answer)
            delay = attempts.after(failure)
            if stop is None:
                time.sleep(delay)
            else:
                stop.wait(delay)

    async def apost(self, path: str, body: Any, deadline: Deadline | None = None, stop: Stop | None = None) -> Any:
        """Async twin of ``post``; ``stop`` cancels the task running it (``Stop.start``), and is checked where a
        cancellation may have been swallowed (``wait_for`` finishing at that moment, before Python 3.12)."""
        deadline = deadline or self.deadline()
        attempts = Attempts(self.endpoints, self.config, deadline, path)
        slots = self._async_client().slots
        while True:
            try:
                await asyncio.wait_for(slots.acquire(), deadline.wait_limit())
            except asyncio.TimeoutError:
                raise attempts.expired(self._no_slot) from None
            try:
                if stop is not None:
                    stop.check(_stopped(path))
                window = attempts.window()
                failure = failure_of_answer(answer := await self._aexchange("POST", attempts.url, body, window))
            except (httpx.RequestError, asyncio.TimeoutError) as exc:
                failure = failure_of_exception(exc, window)
            finally:
                slots.release()
            if failure is None:
                attempts.succeeded()
                return parse_json(answer)
            delay = attempts.after(failure)
            if stop is not None:
                stop.check(_stopped(path))
            await asyncio.sleep(delay)

    def stoppable(self) -> ContextManager[Stop]:
        """A stop for a call, which ``close`` sets (with why) while the block runs: a sync call's tries, waits
        between them (a scoring call's, discovery's rounds) and socket reads given it end at once, and so do an
        async call's tasks started through it. ``Cancelled`` at once once the transport is closed."""
        return self._calls.stoppable()

    def post_all(self, path: str, bodies: Sequence[Any], deadline: Deadline | None = None) -> list[Any]:
        """POST every body, up to ``max_concurrency`` at a time on threads, all within one deadline.

        Answers come in the bodies' order; the first failure ends the call. Closing the transport ends it at once.
        """
        deadline = deadline or self.deadline()
        # Set once the call is over (failed, or past its deadline) or the transport closes: posts still running make
        # no further try.
        with self.stoppable() as stop:
            if len(bodies) == 1:
                return [self.post(path, bodies[0], deadline, stop)]
            futures = self._submit(path, bodies, deadline, stop)
            # Each post ends by the deadline once a thread runs it, with an error naming what it tried; the grace
            # lets that error through, and the bound still holds when every thread is busy with other calls.
            limit = deadline.wait_limit()
            _, pending = wait(futures, None if limit is None else limit + _GRACE, return_when=FIRST_EXCEPTION)
            if pending and deadline.left() <= 0:
                wait(pending, _GRACE)
        error = _first_error(futures)
        stop.set()
        for future in futures:
            future.cancel()
        if error is not None:
            raise error
        if pending:
            raise expired_error(deadline, 0, [],
                                f"{len(pending)} of {len(bodies)} requests to {path} found no free thread")
        return [future.result() for future in futures]

    def _submit(self, path: str, bodies: Sequence[Any], deadline: Deadline, stop: Stop) -> list[Future[Any]]:
        """A post of each body, queued for the worker threads (started on first use, never once closed)."""
        with self._lock:
            if self._executor is None:
                self._calls.check_open()  # threads started after close() would never be shut down
                self._executor = ThreadPoolExecutor(self.config.max_concurrency, thread_name_prefix="rerankit-http")
            executor = self._executor
        try:
            # Each thread runs in a copy of the caller's context: its request id goes with every body.
            return [executor.submit(contextvars.copy_context().run, self.post, path, body, deadline, stop)
                    for body in bodies]
        except RuntimeError:  # close() shut the threads down meanwhile, once it had set the stop: the posts queued end
            stop.check(_stopped(path))
            raise

    async def apost_all(self, path: str, bodies: Sequence[Any], deadline: Deadline | None = None) -> list[Any]:
        """Async twin of ``post_all``: one task per body; the first failure cancels the rest, and so does closing
        the transport, from any thread (the call then raises ``Cancelled``)."""
        deadline = deadline or self.deadline()
        with self.stoppable() as stop:
            tasks = [stop.start(self.apost(path, body, deadline, stop)) for body in bodies]
            try:
                _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                if pending and deadline.left() <= 0:
                    await asyncio.wait(pending, timeout=_GRACE)
            finally:
                error = _first_error(tasks)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        if error is not None:
            raise error
        if any(task.cancelled() for task in tasks):  # by close(): what it set the stop with
            stop.check(_stopped(path))
        return [task.result() for task in tasks]

    def get(self, base_url: str, path: str, deadline: Deadline | None = None, stop: Stop | None = None) -> Reply:
        """One GET (no retries: discovery makes them), for discovery: ``Reply(None, error=...)`` when unreachable,
        past the deadline (``expired``), or given up once ``stop`` is set."""
        deadline = deadline or self.deadline()
        window = Window.open(deadline, self.config.timeout.read)
        try:
            with stopped_by(stop):
                return probe_reply(self._exchange("GET", base_url + path, None, window))
        except httpx.RequestError as exc:
            return self._unreachable(exc, window)

    async def aget(self, base_url: str, path: str, deadline: Deadline | None = None) -> Reply:
        """Async twin of ``get``."""
        deadline = deadline or self.deadline()
        window = Window.open(deadline, self.config.timeout.read)
        try:
            return probe_reply(await self._aexchange("GET", base_url + path, None, window))
        except (httpx.RequestError, asyncio.TimeoutError) as exc:
            return self._unreachable(exc, window)

    @staticmethod
    def _unreachable(exc: Exception, window: Window) -> Reply:
        failure = failure_of_exception(exc, window)
        return Reply(None, error=failure.message, transient=failure.retryable, expired=failure.expired)

    def close(self) -> None:
        """Close the connection pools and the worker threads. The calls running end at once with ``Cancelled``
        (sync ones' posts, queued or between tries, and async ones' tasks, on their loops); none begins after."""
        self._calls.close()  # before the pools are taken: a call running opens no new one (``check_open``)
        with self._lock:
            client, self._client = self._client, None
            executor, self._executor = self._executor, None
            loop_clients, self._loop_clients = list(self._loop_clients.values()), {}
        if client is not None:
            client.close()
        if executor is not None:
            # Queued posts are left to run: each sees its call's stop and ends, so the call's wait returns
            # (cancelled futures would never wake it).
            executor.shutdown(wait=False)
        for loop_client in loop_clients:
            _close_on_loop(loop_client)

    async def aclose(self) -> None:
        """Close everything, awaiting the async pool of the running loop."""
        self._calls.close()  # this loop's calls are cancelled while the pool closes
        with self._lock:
            loop_client = self._loop_clients.pop(asyncio.get_running_loop(), None)
        if loop_client is not None:
            await loop_client.client.aclose()
        self.close()


async def _closes_with_loop(client: httpx.AsyncClient) -> AsyncIterator[None]:
    """Waits at its yield for its loop's ``shutdown_asyncgens``, then closes ``client`` on that loop."""
    try:
        yield
    finally:
        await client.aclose()


async def _started(generator: AsyncIterator[None]) -> None:
    await generator.__anext__()


def _stopped(path: str) -> str:
    """Why a request of a split call stopped when its call, not ``close``, stopped it."""
    return f"the call that POSTs to {path} has failed elsewhere; this request stopped"


_LIVE_TRANSPORTS: "weakref.WeakSet[Transport]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """``os.register_at_fork`` hook: each transport of the parent starts afresh in the child (``_fresh_state``).
    The parent's clients are dropped, not closed: closing would shut connections the parent still uses."""
    for transport in list(_LIVE_TRANSPORTS):
        transport._fresh_state()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_on_loop(loop_client: _LoopClient) -> None:
    """Close an async client from sync code: on its loop, whichever thread that loop runs in."""
    loop = loop_client.loop
    if loop.is_closed():
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        loop.create_task(loop_client.client.aclose())
    elif loop.is_running():
        asyncio.run_coroutine_threadsafe(loop_client.client.aclose(), loop).result(timeout=10)
    else:
        loop.run_until_complete(loop_client.client.aclose())
