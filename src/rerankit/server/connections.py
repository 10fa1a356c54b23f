"""How ``rerankit serve`` takes connections: a connection limit, a request-header deadline, the uvicorn config.

uvicorn's own ``limit_concurrency`` answers a plain-text 503, counts a connection at each request (so a client's
open keep-alive connection can be refused later) and lets idle sockets lock clients out; uvicorn has a keep-alive
timeout but no deadline for a request's headers: a client that connects and sends nothing, or drips a header byte
a second (slowloris), keeps its socket for ever. ``guarded_protocol`` adds both to uvicorn's HTTP protocol
(httptools or h11). Over HTTPS, a socket still in its TLS handshake is counted too (``handshakes.py``), and its
first request's header deadline counts from its accept: the handshake and those headers share one period; and a
connection the server closes itself is let go ``TLS_CLOSE_WAIT_S`` after its close_notify at the most, answered or
not (``_release_soon``). A newcomer over the limit makes one connection give way at the most: an HTTPS connection's
room is found once, as its socket is accepted, and a connection that has given way no longer counts (``gave_way``).
Every request of a connection that is lost, pipelined ones too, is one whose client left (``gone.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from rerankit.errors import TooManyConnections
from rerankit.server.app import path_error_response
from rerankit.server.gone import GoneWithItsRequests
from rerankit.server.routes import ROUTES
from rerankit.server.limits import ServerConfig
from rerankit.server.request_ids import RequestIds

log = logging.getLogger("rerankit.server")

# Lower case: uvicorn's h11 protocol adds its own for a request that asked for a close, unless this very pair is there.
CONNECTION_CLOSE = (b"connection", b"close")
# Over TLS, ``transport.close()`` sends close_notify and then keeps the socket until the client's close_notify comes
# back (asyncio's and uvloop's ssl_shutdown_timeout: 30 s). A connection the server drops itself (``_release_soon``)
# is aborted once this long has passed without it: a silent client never answers, and would keep its file
# descriptor and TLS buffers (RSS: ~60 KiB a connection on uvloop, ~290 KiB on asyncio) that long after its close.
TLS_CLOSE_WAIT_S = 1.0


class _ConnectionGuard:
    """Mixed in before a uvicorn HTTP protocol class; ``guarded_protocol`` sets the class attributes."""

    max_connections: int
    header_timeout_s: float
    over_capacity: Any  # the ASGI app that answers a connection over the limit
    # The server's connections by when they began to wait for a request, oldest first (a dict as an ordered set);
    # one that has a request running may still be in it, and is dropped when met at the front. Each has
    # ``make_room()``: this class's connections, and the ``handshakes``.
    waiting: dict[Any, None]
    handshakes: set[Any]  # HTTPS sockets whose TLS handshake is under way (``handshakes.Handshake``): counted too
    # HTTPS connections the server has closed itself, other than to make room, whose sockets stay until their client
    # answers the close_notify or ``TLS_CLOSE_WAIT_S`` passes (``_release_soon``), oldest first: still open, so
    # counted, but the first to go when a connection over the limit needs room (``close_longest_waiting``).
    closing: dict[Any, None]
    # Connections closed to make room for a newcomer, until they are gone (over TLS, up to ``TLS_CLOSE_WAIT_S``): their
    # room is the newcomer's, so they no longer count, and they are never picked to make room again.
    gave_way: set[Any]
    # The loop time the connection opened, where that was before ``connection_made``: an HTTPS socket's accept, set
    # by its ``Handshake``; None: it opens at ``connection_made`` (plain HTTP).
    opened_at: float | None = None
    # Whether the connection's room was found as its socket was accepted (``Handshake``): it is not counted against
    # the limit a second time, which would make a second connection give way for it.
    has_room: bool = False

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._header_deadline: asyncio.TimerHandle | None = None
        self._release: asyncio.TimerHandle | None = None  # ``_release_soon``'s abort
        self._client_ended = False  # the client has closed its side (``eof_received``)
        # The first request's headers are due header_timeout_s after the connection opened: over HTTPS, after its
        # accept, so the TLS handshake spends the same period (a client dripping the handshake and then its headers
        # gets header_timeout_s in all, as over plain HTTP, not twice that).
        self._arm_header_deadline(self.opened_at)
        # Counted as the connection opens (over HTTPS, as it was accepted): a connection let in is never refused
        # later. Over the limit, the connection that has waited longest for a request makes room (idle sockets cannot
        # lock clients out); the new one is refused only when every other connection has a request running.
        if (not self.has_room and over_limit(type(self), self.connections)  # type: ignore[attr-defined]
                and not close_longest_waiting(self.waiting, self, self.closing)):
            self.app = self.over_capacity

    def on_response_complete(self) -> None:
        # Armed before uvicorn starts a pipelined request that may already be waiting: its cycle then differs.
        self._arm_header_deadline()
        super().on_response_complete()  # type: ignore[misc]
        # after the client's end of the stream, uvicorn has started the next request sent before it, if any
        transport = self.transport  # type: ignore[attr-defined]
        if self._client_ended and not transport.is_closing() and not self._answer_then_close():
            transport.close()

    def eof_received(self) -> bool | None:
        """The client has closed its side (``shutdown(SHUT_WR)``: ``nc -N``, some health checkers). uvicorn closes
        the connection at once, dropping the answers: each whole request sent before that end is now answered in
        turn, then the connection closes (RFC 9112 sections 9.3 and 9.6; ``_answer_then_close``)."""
        self._client_ended = True
        return True if self._answer_then_close() else None  # None: the transport closes

    def _answer_then_close(self) -> bool:
        """Whether the connection stays open, after the client's end of the stream, to answer what it sent before:
        asked at that end and after each answer. While requests sent behind the one being answered wait for it, yes;
        then the end applies to the last request: a whole one is answered and the connection closes after it (an
        answer not begun yet says ``Connection: close``), except on a scoring route, where the end of the stream is
        how a client that left (a timeout, close()) is told from one that waits, and its work is cancelled
        (``disconnect.py``): the two cannot be told apart before an answer is written. Never over TLS, whose layer
        closes in any case."""
        cycle = self.cycle  # type: ignore[attr-defined]  # httptools: the newest request, h11: the one answered
        if self.scheme == "https" or cycle is None:  # type: ignore[attr-defined]
            return False
        if getattr(self, "pipeline", None):  # httptools: requests it parsed wait behind the one being answered
            return True
        if cycle.response_complete or cycle.more_body:  # answered, or not whole: nothing more to answer
            return False
        conn = getattr(self, "conn", None)  # h11 parses a request sent behind only once this one is answered
        if conn is not None and conn.trailing_data[0]:
            return True
        if cycle.scope.get("path") in ROUTES:
            return False
        cycle.keep_alive = False  # closed once answered
        if not cycle.response_started and CONNECTION_CLOSE not in cycle.default_headers:
            # Both protocols write the cycle's default headers first in its answer. uvicorn's httptools protocol
            # writes the header for keep_alive alone; h11 (the library) only for its own keep-alive state, which
            # keep_alive does not reach. Among the defaults, the header is in the answer once either way; asked
            # again (the end of the stream is read again when reading resumes), it is not added twice.
            cycle.default_headers = [*cycle.default_headers, CONNECTION_CLOSE]
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        if self._release is not None:
            self._release.cancel()
        self.waiting.pop(self, None)
        self.closing.pop(self, None)
        self.gave_way.discard(self)
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm_header_deadline(self, since: float | None = None) -> None:
        """Close the connection unless a request's headers are complete within ``header_timeout_s`` of ``since``
        (a loop time; None: now).

        Both protocols start a new request cycle exactly when a request's headers are complete; unlike the
        keep-alive timer, bytes that arrive do not push this deadline back.
        """
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        self._waiting_after = self.cycle  # type: ignore[attr-defined]
        self._unsent: int | None = None  # the answer's bytes left unsent at the last deadline (``_stalled_reader``)
        self.waiting.pop(self, None)
        self.waiting[self] = None
        loop = self.loop  # type: ignore[attr-defined]
        # a time already past (a handshake done at the very end of its period) is due at the loop's next turn
        self._header_deadline = loop.call_at((loop.time() if since is None else since) + self.header_timeout_s,
                                             self._headers_overdue)

    def _idle_since_armed(self) -> bool:
        """Whether no request runs on this connection and none has come since the deadline was armed."""
        cycle = self.cycle  # type: ignore[attr-defined]
        # httptools makes a pipelined request's cycle as its headers arrive, before the previous response ends:
        # that request may still be running when the deadline armed at that response comes.
        answering = cycle is not None and not cycle.response_complete
        return cycle is self._waiting_after and not answering

    def _waiting_for_headers(self) -> bool:
        """Whether no request runs on this connection, none has come since the deadline was armed, and it is open."""
        return self._idle_since_armed() and not self.transport.is_closing()  # type: ignore[attr-defined]

    def _stalled_reader(self) -> bool:
        """Whether its last answer still sits unsent in the write buffer, and no byte of it left since the last look:
        the client stopped reading. ``transport.close()`` waits for that buffer to flush, so such a connection (and
        the answer it holds) would stay open, and counted against ``max_connections``, for ever."""
        size, before = self.transport.get_write_buffer_size(), self._unsent  # type: ignore[attr-defined]
        self._unsent = size
        return size > 0 and before is not None and size >= before

    def _headers_overdue(self) -> None:
        self._header_deadline = None
        if not self._idle_since_armed():
            return
        if self.transport.get_write_buffer_size():  # type: ignore[attr-defined]
            if self._stalled_reader():
                self.transport.abort()  # type: ignore[attr-defined]
            else:  # the client still reads its answer: give it another period
                self._header_deadline = self.loop.call_later(  # type: ignore[attr-defined]
                    self.header_timeout_s, self._headers_overdue)
        else:  # idle, or closing since its last answer (over TLS, its client may not answer the close_notify)
            if not self.transport.is_closing():  # type: ignore[attr-defined]
                self.transport.close()  # type: ignore[attr-defined]
            self._release_soon()

    def make_room(self) -> bool:
        """Close this connection if it waits for a request (``close_longest_waiting``); False if it has one running."""
        if self._waiting_for_headers():
            self.gave_way.add(self)
            self.transport.close()  # type: ignore[attr-defined]
            self._release_soon()
            return True
        if self._idle_since_armed() and self.transport.is_closing():  # type: ignore[attr-defined]
            # answered and closing, its client not reading the rest: nothing runs
            self.gave_way.add(self)
            self.transport.abort()  # type: ignore[attr-defined]
            return True
        return False

    def timeout_keep_alive_handler(self) -> None:
        super().timeout_keep_alive_handler()  # type: ignore[misc]  # closes the idle connection
        self._release_soon()

    def shutdown(self) -> None:
        """uvicorn's: an idle connection closes now, a busy one once answered. Not one already closing: uvicorn
        would close it again, and asyncio's TLS transport, closed twice, drops its TLS layer, which its abort() and
        get_write_buffer_size() then need (the latter raised AttributeError in ``_headers_overdue``)."""
        if not self.transport.is_closing():  # type: ignore[attr-defined]
            super().shutdown()  # type: ignore[misc]
        self._release_soon()

    def _release_soon(self) -> None:
        """Over TLS, abort this connection, which the server has closed, unless it is gone ``TLS_CLOSE_WAIT_S`` from
        now: for a connection the server drops itself (idle or dripping past its header deadline, idle past the
        keep-alive timeout, making room, shutting down). Its close_notify is sent, and a client that reads answers
        it within that time (a clean close); one that does not read (a slowloris, an idle socket, a client pool's
        idle connection) no longer keeps the socket and its TLS buffers for the TLS layer's 30 s. Meanwhile it is
        among the ``closing``, the first to go for a newcomer over the limit. Plain HTTP: its close has already
        freed the socket, or waits for a client still reading its answer (``_headers_overdue``)."""
        if (self.scheme != "https" or self._release is not None  # type: ignore[attr-defined]
                or not self.transport.is_closing()):  # type: ignore[attr-defined]
            return
        self._release = self.loop.call_later(TLS_CLOSE_WAIT_S, self.release)  # type: ignore[attr-defined]
        if self not in self.gave_way:
            self.closing[self] = None

    def release(self) -> None:
        """Let the socket of this closed connection go now (``_release_soon``)."""
        self.closing.pop(self, None)
        self.transport.abort()  # type: ignore[attr-defined]

    def give_way(self) -> None:
        """Let this closed connection go now to make room for a newcomer (``close_longest_waiting``)."""
        self.gave_way.add(self)
        self.release()


def over_limit(guard: Any, connections: set[Any]) -> bool:
    """Whether more connections are open than the guarded protocol class ``guard`` allows: uvicorn's
    ``connections`` and the HTTPS sockets in their TLS handshake, less those that have given way to a newcomer."""
    open_now = len(connections) + len(guard.handshakes) - len(guard.gave_way & connections)
    return open_now > guard.max_connections


def close_longest_waiting(waiting: dict[Any, None], newest: Any, closing: dict[Any, None]) -> bool:
    """Close the connection of ``waiting`` that has waited longest for a request, other than ``newest`` (the last
    one in); False when none is waiting. A connection of ``closing`` (the guard's), already closed, goes first: its
    socket is let go at once, and no connection that might still send a request is closed. Either gives way: it no
    longer counts, and is not picked again (``gave_way``)."""
    if closing:
        connection = next(iter(closing))
        waiting.pop(connection, None)
        connection.give_way()
        return True
    while waiting:
        connection = next(iter(waiting))
        if connection is newest:  # every other one has a request running
            return False
        del waiting[connection]  # waiting or not: one that waits again is put back at the end
        if connection.make_room():
            return True
    return False


def guarded_protocol(config: ServerConfig, base: type[asyncio.Protocol] = AutoHTTPProtocol,
                     metrics: Any = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol ``base`` with ``config``'s connection limit and request-header deadline, whose
    requests all go with a connection that is lost (``gone.py``); ``metrics`` (the server's ``Metrics``) counts the
    503s of connections over the limit."""
    attributes = {"max_connections": config.max_connections, "header_timeout_s": config.header_timeout_s,
                  "over_capacity": staticmethod(over_capacity_app(config, metrics)), "waiting": {},
                  "handshakes": set(), "closing": {}, "gave_way": set()}
    return type(f"Guarded{base.__name__}", (GoneWithItsRequests, _ConnectionGuard, base), attributes)


def over_capacity_app(config: ServerConfig, metrics: Any = None) -> Any:
    """The ASGI app answering a connection over ``max_connections``: one JSON 503, then close. A scoring path answers
    it as its own errors (``routes.default_dialect``, ``routes.error_response``); any other path as the app does;
with the request's ``X-Request-Id``, as every answer of the app."""
    error = TooManyConnections(f"the server holds its limit of {config.max_connections} connections "
                               "(max_connections), each with a request running; retry later")

    async def over_capacity(scope: dict[str, Any], receive: Any, send: Any) -> None:
        started = time.perf_counter()
        path = scope.get("path", "")
        response = path_error_response(path, error, config)
        response.headers["Connection"] = "close"
        await response(scope, receive, send)
        if metrics is not None and path in ROUTES:  # load turned away is counted as every scoring answer is
            metrics.observe_request(path, error.status_code, time.perf_counter() - started)

    return RequestIds(over_capacity)  # its 503 carries an X-Request-Id too


def uvicorn_config(app: Any, config: ServerConfig, protocol: type[asyncio.Protocol] = AutoHTTPProtocol,
                   **options: Any) -> Any:
    """The uvicorn ``Config`` of ``app`` with ``config``'s connection settings on uvicorn's HTTP ``protocol``
    (httptools where installed, else h11); ``options`` go to uvicorn as is."""
    import uvicorn

    metrics = getattr(getattr(getattr(app, "state", None), "batcher", None), "metrics", None)
    return uvicorn.Config(app, http=guarded_protocol(config, protocol, metrics),
                          timeout_keep_alive=config.keep_alive_timeout_s, **options)


def address(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
