"""The remote backend's transport: pooled httpx clients, retries with backoff, a concurrency limit and
several endpoints with failover. It moves JSON bodies; what they mean is the dialects' business.

The sync and async paths share every decision (``_Attempts``, ``_failure``); only the I/O differs.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import httpx

from rerankit.errors import InvalidRequest, RemoteError
from rerankit.remote.dialects import read_error
from rerankit.remote.dialects.common import param_first


@dataclass(frozen=True)
class Timeout:
    """Seconds to open a connection and to wait for the server's next bytes."""

    connect: float = 5.0
    read: float = 60.0


@dataclass(frozen=True)
class ClientConfig:
    """How the transport retries, waits and limits itself.

    Retries go to connect errors, read timeouts, broken responses, 429 and 5xx, never to other 4xx.
    The n-th retry waits ``backoff_base * 2**(n-1)`` seconds with jitter (or the server's ``Retry-After``),
    at most ``backoff_max``; a retry that fails over to a live endpoint not yet tried does not wait.
    An endpoint that refuses connections sits out ``dead_cooldown`` seconds.
    """

    timeout: Timeout = field(default_factory=Timeout)
    max_retries: int = 3
    backoff_base: float = 0.25
    backoff_max: float = 10.0
    max_concurrency: int = 8
    dead_cooldown: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_retries", "backoff_base", "backoff_max", "dead_cooldown"):
            if getattr(self, name) < 0:
                raise InvalidRequest(name, f"must be >= 0, got {getattr(self, name)}")
        if self.max_concurrency < 1:
            raise InvalidRequest("max_concurrency", f"must be >= 1, got {self.max_concurrency}")

    def backoff(self, retry: int, retry_after: float | None) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        if retry_after is not None:
            return min(retry_after, self.backoff_max)
        return min(self.backoff_max, self.backoff_base * 2 ** (retry - 1)) * random.uniform(0.5, 1.0)


class Endpoints:
    """Base URLs taken in turn (round-robin); one that refuses connections goes last for a cool-down."""

    def __init__(self, urls: Sequence[str], cooldown: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not urls:
            raise InvalidRequest("urls", "give at least one server URL")
        self.urls = [url.rstrip("/") for url in urls]
        self._cooldown = cooldown
        self._clock = clock
        self._dead_until: dict[str, float] = {}
        self._turn = 0
        self._lock = threading.Lock()

    def order(self) -> list[str]:
        """Every URL: the live ones, starting with the next in turn, then those cooling down."""
        live = [url for url in self.urls if self.is_live(url)]
        cooling = [url for url in self.urls if url not in live]
        with self._lock:
            turn = self._turn
            self._turn += 1
        start = turn % len(live) if live else 0
        return live[start:] + live[:start] + cooling

    def is_live(self, url: str) -> bool:
        """False while ``url`` cools down after refusing a connection."""
        return self._dead_until.get(url, 0.0) <= self._clock()

    def mark_dead(self, url: str) -> None:
        """Send ``url`` to the back of the line for the cool-down."""
        self._dead_until[url] = self._clock() + self._cooldown


@dataclass(frozen=True)
class _Failure:
    """Why one try failed, and whether another is worth it."""

    message: str
    retryable: bool
    status: int | None = None
    endpoint_down: bool = False
    retry_after: float | None = None
    body: str | None = None


# Transport errors after which the same request may well succeed: the server was busy, restarting or slow.
_RETRYABLE_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


def _failure_of_exception(exc: httpx.TransportError) -> _Failure:
    return _Failure(message=f"{type(exc).__name__}: {exc}", retryable=isinstance(exc, _RETRYABLE_ERRORS),
                    endpoint_down=isinstance(exc, _CONNECT_ERRORS))


def _failure_of_response(response: httpx.Response) -> _Failure | None:
    """None for a success; else the server's message, retryable for 429 and 5xx."""
    if response.is_success:
        return None
    try:
        message, param = read_error(response.json())
    except ValueError:
        message, param = None, None
    text = response.text[:2000]
    message = param_first(message, param) if message is not None else text[:300] or response.reason_phrase
    status = response.status_code
    return _Failure(message=message, retryable=status == 429 or status >= 500, status=status,
                    retry_after=_retry_after(response), body=text)


def _retry_after(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds (the HTTP-date form is left to the backoff)."""
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


def _json(response: httpx.Response, url: str) -> Any:
    try:
        return response.json()
    except ValueError:
        raise RemoteError("response is not JSON", response.status_code, url, response.text[:2000]) from None


class _Attempts:
    """The tries of one request: which endpoint is next, and how long to wait before it."""

    def __init__(self, endpoints: Endpoints, config: ClientConfig) -> None:
        self._endpoints = endpoints
        self._config = config
        self._order = endpoints.order()
        self.tries = 0

    @property
    def url(self) -> str:
        """The base URL of the current try."""
        return self._order[self.tries % len(self._order)]

    def after(self, failure: _Failure, path: str) -> float:
        """Seconds to wait before the next try; raises ``RemoteError`` when there is none."""
        failed_url = self.url
        if failure.endpoint_down:
            self._endpoints.mark_dead(failed_url)
        self.tries += 1
        if not failure.retryable or self.tries > self._config.max_retries:
            where = failed_url + path
            if failure.status is not None:
                raise RemoteError(failure.message, failure.status, where, failure.body)
            raise RemoteError(f"{failure.message} ({where}, {self.tries} tries)", url=where)
        # Fail over at once to a live endpoint not yet tried; once all have failed, back off.
        if self.tries < len(self._order) and self._endpoints.is_live(self.url):
            return 0.0
        return self._config.backoff(self.tries, failure.retry_after)


@dataclass(frozen=True)
class Reply:
    """A discovery probe's answer: HTTP status (None when unreachable) and JSON body (None when not JSON)."""

    status: int | None
    body: Any = None


def _reply(response: httpx.Response) -> Reply:
    try:
        return Reply(response.status_code, response.json())
    except ValueError:
        return Reply(response.status_code)


@dataclass
class _LoopClient:
    """The async client and slots of one event loop (httpx connections belong to the loop that made them)."""

    loop: asyncio.AbstractEventLoop
    client: httpx.AsyncClient
    slots: asyncio.Semaphore


class Transport:
    """Posts JSON bodies to a set of endpoints, sync or async, with retries, failover and a concurrency limit.

    ``transport``: an httpx transport for both clients (``httpx.MockTransport`` in tests).
    """

    def __init__(self, urls: Sequence[str], config: ClientConfig | None = None, api_key: str | None = None,
                 transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config or ClientConfig()
        self.endpoints = Endpoints(urls, self.config.dead_cooldown)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport
        self._slots = threading.BoundedSemaphore(self.config.max_concurrency)
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._loop_client: _LoopClient | None = None

    def _client_options(self) -> dict[str, Any]:
        timeout = self.config.timeout
        limit = self.config.max_concurrency
        return {"headers": self._headers, "timeout": httpx.Timeout(timeout.read, connect=timeout.connect),
                "limits": httpx.Limits(max_connections=limit, max_keepalive_connections=limit)}

    def _sync_client(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                transport = self._transport if isinstance(self._transport, httpx.BaseTransport) else None
                self._client = httpx.Client(transport=transport, **self._client_options())
            return self._client

    def _async_client(self) -> _LoopClient:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._loop_client is None or self._loop_client.loop is not loop:
                # A client made under an earlier (now finished) loop cannot be reused or closed from this one.
                transport = self._transport if isinstance(self._transport, httpx.AsyncBaseTransport) else None
                self._loop_client = _LoopClient(loop, httpx.AsyncClient(transport=transport, **self._client_options()),
                                                asyncio.Semaphore(self.config.max_concurrency))
            return self._loop_client

    def post(self, path: str, body: Any) -> Any:
        """POST ``body`` to ``path`` of an endpoint, retrying per the config; the JSON answer."""
        attempts = _Attempts(self.endpoints, self.config)
        client = self._sync_client()
        while True:
            url = attempts.url + path
            try:
                with self._slots:
                    response = client.post(url, json=body)
                failure = _failure_of_response(response)
            except httpx.TransportError as exc:
                failure = _failure_of_exception(exc)
            if failure is None:
                return _json(response, url)
            time.sleep(attempts.after(failure, path))

    async def apost(self, path: str, body: Any) -> Any:
        """Async twin of ``post``."""
        attempts = _Attempts(self.endpoints, self.config)
        state = self._async_client()
        while True:
            url = attempts.url + path
            try:
                async with state.slots:
                    response = await state.client.post(url, json=body)
                failure = _failure_of_response(response)
            except httpx.TransportError as exc:
                failure = _failure_of_exception(exc)
            if failure is None:
                return _json(response, url)
            await asyncio.sleep(attempts.after(failure, path))

    def post_all(self, path: str, bodies: Sequence[Any]) -> list[Any]:
        """POST every body, up to ``max_concurrency`` at a time on threads; answers in the bodies' order."""
        if len(bodies) == 1:
            return [self.post(path, bodies[0])]
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.config.max_concurrency, thread_name_prefix="rerankit-http")
            executor = self._executor
        futures = [executor.submit(self.post, path, body) for body in bodies]
        try:
            return [future.result() for future in futures]
        finally:
            for future in futures:
                future.cancel()

    async def apost_all(self, path: str, bodies: Sequence[Any]) -> list[Any]:
        """Async twin of ``post_all``: one task per body; the first failure cancels the rest."""
        tasks = [asyncio.ensure_future(self.apost(path, body)) for body in bodies]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def get(self, base_url: str, path: str) -> Reply:
        """One GET (no retries), for discovery."""
        try:
            return _reply(self._sync_client().get(base_url + path))
        except httpx.TransportError:
            return Reply(None)

    async def aget(self, base_url: str, path: str) -> Reply:
        """Async twin of ``get``."""
        try:
            return _reply(await self._async_client().client.get(base_url + path))
        except httpx.TransportError:
            return Reply(None)

    def close(self) -> None:
        """Close the connection pools and the worker threads."""
        with self._lock:
            client, self._client = self._client, None
            executor, self._executor = self._executor, None
            loop_client, self._loop_client = self._loop_client, None
        if client is not None:
            client.close()
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        if loop_client is not None:
            _close_on_loop(loop_client)

    async def aclose(self) -> None:
        """Close everything, awaiting the async pool of the running loop."""
        with self._lock:
            loop_client = self._loop_client
            mine = loop_client is not None and loop_client.loop is asyncio.get_running_loop()
            if mine:
                self._loop_client = None
        if mine:
            await loop_client.client.aclose()
        self.close()


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
