"""Time limits of a remote call: the call's deadline, each try's window, and the sync client held to them.

httpx's timeouts bound each socket operation, so a server sending a byte a second never trips a 2 s read
timeout. The async client is held to a window by ``asyncio.wait_for``; the sync client by cutting every socket
operation's timeout to what is left of the window, in the httpcore network backend below.
"""

from __future__ import annotations

import math
import ssl
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import httpcore
import httpx

# When the sync try in progress (in this thread or task) must be over, on the monotonic clock.
_WINDOW_ENDS: ContextVar[float | None] = ContextVar("rerankit_window_ends", default=None)
# The stop of the split call the sync try in progress belongs to (``Transport.post_all``): once set, a read
# waiting for the far server gives up within ``STOP_POLL`` seconds, so the call's other requests end with it.
_STOP: ContextVar[Any] = ContextVar("rerankit_stop", default=None)
STOP_POLL = 0.05
# A socket timeout of 0 would make the socket non-blocking (an OSError, not a timeout): the smallest wait instead.
_LEAST_WAIT = 0.001


class Deadline:
    """When a whole call must be over; ``seconds=None`` never expires."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.ends_at = math.inf if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left (inf without a deadline, negative once passed)."""
        return self.ends_at - time.monotonic()

    def wait_limit(self) -> float | None:
        """Seconds left as a blocking call's ``timeout`` argument (None without a deadline)."""
        return None if self.seconds is None else max(self.left(), 0.0)


@dataclass(frozen=True)
class Window:
    """One try's time: ``seconds`` long from its start, its try timeout or, if sooner, the call's deadline."""

    ends_at: float
    seconds: float
    by_deadline: bool

    @classmethod
    def open(cls, deadline: Deadline, try_seconds: float) -> "Window":
        """The window of a try starting now."""
        now = time.monotonic()
        if deadline.ends_at <= now + try_seconds:
            return cls(deadline.ends_at, max(deadline.ends_at - now, 0.0), by_deadline=True)
        return cls(now + try_seconds, try_seconds, by_deadline=False)

    def left(self) -> float:
        """Seconds left, at least 0."""
        return max(self.ends_at - time.monotonic(), 0.0)

    def over(self) -> bool:
        """True once the window has ended (timers wake a little early or late: 10 ms of slack)."""
        return self.ends_at - time.monotonic() <= 0.01


@contextmanager
def held_to(window: Window) -> Iterator[None]:
    """Sync socket operations made inside end with ``window`` (in a client passed through ``hold_sockets``)."""
    token = _WINDOW_ENDS.set(window.ends_at)
    try:
        yield
    finally:
        _WINDOW_ENDS.reset(token)


@contextmanager
def stopped_by(stop: Any) -> Iterator[None]:
    """Sync socket reads made inside give up once ``stop`` (a ``threading.Event``, or None) is set."""
    token = _STOP.set(stop)
    try:
        yield
    finally:
        _STOP.reset(token)


def _held(timeout: float | None) -> float | None:
    ends_at = _WINDOW_ENDS.get()
    if ends_at is None:
        return timeout
    left = ends_at - time.monotonic()
    return max(left if timeout is None else min(timeout, left), _LEAST_WAIT)


class _HeldStream(httpcore.NetworkStream):
    """A socket stream whose every read and write waits at most until the window's end."""

    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        wait, stop = _held(timeout), _STOP.get()
        if stop is None:
            return self._stream.read(max_bytes, wait)
        # In steps of STOP_POLL: a read that times out took no bytes, so it can be made again.
        ends_at = None if wait is None else time.monotonic() + wait
        while True:
            left = None if ends_at is None else max(ends_at - time.monotonic(), _LEAST_WAIT)
            step = STOP_POLL if left is None else min(left, STOP_POLL)
            try:
                return self._stream.read(max_bytes, step)
            except httpcore.ReadTimeout:
                if stop.is_set():
                    raise httpcore.ReadError("the call this request belonged to has ended") from None
                if left is not None and left <= STOP_POLL:
                    raise

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _held(timeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _HeldStream(self._stream.start_tls(ssl_context, server_hostname, _held(timeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _HeldBackend(httpcore.NetworkBackend):
    """Opens connections whose streams are held to the window of the try in progress."""

    def __init__(self, backend: httpcore.NetworkBackend) -> None:
        self._backend = backend

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _HeldStream(self._backend.connect_tcp(host, port, _held(timeout), local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _HeldStream(self._backend.connect_unix_socket(path, _held(timeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


def hold_sockets(client: httpx.Client) -> httpx.Client:
    """``client``, the socket operations of its transports (direct and through proxies) held to the try's window."""
    # httpx has no hook for the network backend: each of its transports keeps an httpcore pool (``_pool``, httpx 0.18
    # to 0.28) that takes its sockets from ``_network_backend``. A transport without one (a mock) is left as it is;
    # tests/remote/test_remote_deadlines.py fails if httpx moves them.
    for transport in (client._transport, *client._mounts.values()):
        pool = getattr(transport, "_pool", None)
        if pool is not None:
            pool._network_backend = _HeldBackend(pool._network_backend)
    return client
