"""A connection that is gone takes every request sent on it (``GoneWithItsRequests``, mixed into the server's HTTP
protocol by ``connections.guarded_protocol``).

uvicorn tells only its newest request cycle that its connection was lost. Its httptools protocol parses the requests
pipelined behind the one being answered as they arrive, so that newest one is queued, and the request running goes
on: its engine call runs to the end and its answer is written to the closed transport (on uvloop the write raises
RuntimeError, logged with its traceback). Here every cycle of the connection not yet answered is marked disconnected
and woken: the running request's ``receive()`` returns ``http.disconnect``, so its work is cancelled
(``disconnect.py``) and uvicorn writes nothing for it; those queued behind it never start.

After the client's end of the stream, a connection kept open to answer what was sent before it
(``connections._ConnectionGuard._answer_then_close``) is not read again by either loop, so a reset that follows (a
client that closed rather than half-closed resets once an answer reaches it) would be seen only when an answer is
written. ``ResetWatch`` looks for that reset alone and the connection is aborted as soon as it comes.
"""

from __future__ import annotations

import asyncio
import select
from typing import Any, Callable


class ResetWatch:
    """Calls ``on_reset`` once, when the socket ``fd`` is reset or fails (EPOLLHUP, EPOLLERR), never for its end of
    the stream, which keeps a socket readable. The socket sits in an epoll of its own, whose descriptor the loop
    reads; Linux only (``available``)."""

    available = hasattr(select, "epoll")

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, on_reset: Callable[[], None]) -> None:
        self._loop = loop
        self._on_reset = on_reset
        self._epoll = select.epoll()
        try:
            self._epoll.register(fd, 0)  # no event asked for: epoll reports EPOLLHUP and EPOLLERR all the same
            loop.add_reader(self._epoll.fileno(), self._fired)
        except BaseException:
            self._epoll.close()
            raise

    def _fired(self) -> None:
        if self._epoll.poll(0):
            self.close()
            self._on_reset()

    def close(self) -> None:
        if not self._epoll.closed:
            self._loop.remove_reader(self._epoll.fileno())
            self._epoll.close()


class GoneWithItsRequests:
    """Mixed in before ``connections._ConnectionGuard``: keeps the request cycles uvicorn makes on this connection
    (as it sets ``cycle``) until answered; when the connection is lost, each one still unanswered is marked
    disconnected, and httptools' queue of pipelined requests is dropped."""

    _cycle: Any = None
    _unanswered: tuple[Any, ...] = ()
    _reset_watch: ResetWatch | None = None

    @property
    def cycle(self) -> Any:
        """uvicorn's request cycle: with httptools the newest request parsed, with h11 the one being answered."""
        return self._cycle

    @cycle.setter
    def cycle(self, cycle: Any) -> None:
        self._cycle = cycle
        if cycle is not None:
            self._unanswered = (*(known for known in self._unanswered if not known.response_complete), cycle)

    def eof_received(self) -> bool | None:
        kept_open = super().eof_received()  # type: ignore[misc]
        if kept_open and self._reset_watch is None and ResetWatch.available:
            transport = self.transport  # type: ignore[attr-defined]
            sock = transport.get_extra_info("socket")
            try:
                self._reset_watch = ResetWatch(self.loop, sock.fileno(), transport.abort)  # type: ignore[attr-defined]
            except (AttributeError, OSError, ValueError):  # no socket to watch: a reset is seen at the next write
                pass
        return kept_open

    def connection_lost(self, exc: Exception | None) -> None:
        if self._reset_watch is not None:
            self._reset_watch.close()
        super().connection_lost(exc)  # type: ignore[misc]  # marks uvicorn's newest cycle disconnected
        for cycle in self._unanswered:
            if not cycle.response_complete:
                cycle.disconnected = True  # uvicorn's send() then writes nothing, and receive() says so
                cycle.message_event.set()
        self._unanswered = ()
        pipeline = getattr(self, "pipeline", None)  # httptools: requests parsed, not started
        if pipeline:
            pipeline.clear()
