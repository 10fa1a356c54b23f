"""One request's tries: what a failed try means (``Failure``: retryable, the endpoint down, the server's message and
``Retry-After``) and what comes next (``Attempts``: the next endpoint, its time window, the wait before it, or the
error that ends the call). The transport's sync and async paths share every one of these decisions.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import httpx

from rerankit.errors import RemoteError
from rerankit.remote.deadline import Deadline, Window
from rerankit.remote.dialects import read_error
from rerankit.remote.dialects.common import param_first
from rerankit.remote.endpoints import Endpoints
from rerankit.remote.reply import Answer, retry_after_of, retryable_status

if TYPE_CHECKING:
    from rerankit.remote.client import ClientConfig


@dataclass(frozen=True)
class Failure:
    """Why one try failed, and whether another is worth it."""

    message: str
    retryable: bool
    status: int | None = None
    endpoint_down: bool = False
    retry_after: float | None = None
    body: str | None = None
    expired: bool = False
    param: str | None = None  # the field the server's error body named


# Transport errors after which the same request may well succeed: the server was busy, restarting or slow.
RETRYABLE_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


def failure_of_exception(exc: Exception, window: Window) -> Failure:
    """The failure of a try that raised ``exc`` (an httpx error, or ``asyncio.TimeoutError`` when its window ended)."""
    # Waiting for a free connection of our own pool says nothing about the server.
    timed_out = (isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError))
                 and not isinstance(exc, httpx.PoolTimeout))
    if timed_out and window.over():
        # The try had its time (or all the call had left) and got no complete answer: set the endpoint aside.
        return Failure(message=f"no complete answer within {window.seconds:.3g} s", retryable=True,
                        endpoint_down=True, expired=window.by_deadline)
    return Failure(message=f"{type(exc).__name__}: {exc}", retryable=isinstance(exc, RETRYABLE_ERRORS),
                    endpoint_down=isinstance(exc, CONNECT_ERRORS) or timed_out)


def failure_of_answer(answer: Answer) -> Failure | None:
    """None for a success; else the server's message, retryable for 429 and 5xx."""
    if 200 <= answer.status < 300:
        return None
    try:
        message, param = read_error(answer.json())
    except (ValueError, RecursionError):
        message, param = None, None
    text = answer.text[:2000]
    reason = httpx.codes.get_reason_phrase(answer.status)
    message = param_first(message, param) if message is not None else text[:300] or reason
    status = answer.status
    return Failure(message=message, retryable=retryable_status(status), status=status,
                    retry_after=retry_after_of(answer.headers), body=text, param=param)


def expired_error(deadline: Deadline, tries: int, tried: Sequence[str], last: str | None) -> RemoteError:
    """The error of a call whose deadline passed: the deadline, the endpoints tried and the last failure."""
    where = ", ".join(tried) or "no endpoint reached"
    message = f"deadline of {deadline.seconds:g} s passed after {tries} tries ({where})"
    return RemoteError(message + (f"; last: {last}" if last else ""), url=tried[-1] if tried else None)


class Attempts:
    """The tries of one request: which endpoint is next, its time window, and how long to wait before it."""

    def __init__(self, endpoints: Endpoints, config: ClientConfig, deadline: Deadline, path: str) -> None:
        self._endpoints = endpoints
        self._config = config
        self._deadline = deadline
        self._path = path
        self._order = endpoints.order()
        self._tried: list[str] = []
        self.tries = 0

    @property
    def endpoint(self) -> str:
        """The base URL of the current try."""
        return self._order[self.tries % len(self._order)]

    @property
    def url(self) -> str:
        """The full URL of the current try."""
        return self.endpoint + self._path

    def window(self) -> Window:
        """The current try's window; a ``RemoteError`` once the deadline has passed."""
        if self._deadline.left() <= 0:
            raise self.expired()
        return Window.open(self._deadline, self._config.timeout.read)

    def expired(self, last: str | None = None) -> RemoteError:
        """The error for a deadline that passed (during ``last``, what was going on, if known)."""
        return expired_error(self._deadline, self.tries, self._tried, last)

    def succeeded(self) -> None:
        """The current try's endpoint answered."""
        self._endpoints.mark_live(self.endpoint)

    def after(self, failure: Failure) -> float:
        """Seconds to wait before the next try; raises ``RemoteError`` when there is none."""
        failed_url = self.url
        if failed_url not in self._tried:
            self._tried.append(failed_url)
        if failure.endpoint_down:
            self._endpoints.mark_dead(self.endpoint)
        self.tries += 1
        if failure.expired:
            raise self.expired(failure.message)
        if not failure.retryable or self.tries > self._config.max_retries:
            if failure.status is not None:
                raise status_error(failure, failed_url)
            raise RemoteError(f"{failure.message} ({failed_url}, {self.tries} tries)", url=failed_url)
        # Fail over at once to a live endpoint not yet tried; once all have failed, back off.
        if self.tries < len(self._order) and self._endpoints.is_live(self._order[self.tries]):
            return 0.0
        wait = self._config.backoff(self.tries, failure.retry_after)
        if wait >= self._deadline.left():
            if failure.status is not None and failure.retry_after is not None:
                raise status_error(failure, failed_url)  # the server said when to come back: that, not a deadline
            raise self.expired(failure.message)
        return wait


def status_error(failure: Failure, url: str) -> RemoteError:
    """The error of a try the server answered with an error status, its ``Retry-After`` kept."""
    return RemoteError(failure.message, failure.status, url, failure.body, failure.param, failure.retry_after)
