"""HTTPS connections counted from the moment they are accepted.

asyncio's and uvloop's TLS servers (``create_server(ssl=...)``) hand a connection to its protocol only once the TLS
handshake is done: until then the connection guard (``connections.py``) does not see it, so sockets that never send
a ClientHello were not counted against ``max_connections`` and piled up (a file descriptor and ~45 KiB each) until
the handshake timeout. Here ``TlsListener`` accepts the sockets itself and each is a ``Handshake``: counted, and
among the connections waiting for a request (the one that has waited longest makes room for a newcomer over the
limit), while the loop's own TLS layer (``loop.connect_accepted_socket``) does the handshake within ``timeout_s``;
then the guarded HTTP protocol takes the connection over, its first request's header deadline counted from the
accept (``opened_at``): the handshake and those headers share one period, as the opening and the headers of a
plain-HTTP connection do. Its room is found at the accept (``has_room``): the protocol does not count it again, so
that one newcomer never makes two connections give way.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
from typing import Any, Callable

from rerankit.server.connections import close_longest_waiting, over_limit

log = logging.getLogger("rerankit.server")

ACCEPT_RETRY_S = 1.0  # as asyncio: out of file descriptors, accepting pauses this long


class TlsListener:
    """Accepts on the bound socket ``sock`` and starts a ``Handshake`` of each connection (``handshake(sock)``). It
    stands in uvicorn's ``servers`` list: ``close()`` stops accepting (uvicorn closes the socket itself)."""

    def __init__(self, sock: socket.socket, backlog: int, handshake: Callable[[socket.socket], None]) -> None:
        self.sock, self.backlog, self.handshake = sock, backlog, handshake
        self.loop = asyncio.get_running_loop()
        self._closed = False
        sock.setblocking(False)
        sock.listen(backlog)
        self.loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(self.backlog):  # as asyncio: every connection waiting, a backlog at most a turn
            try:
                connection, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise  # the loop logs it
                log.error("cannot accept a connection: %s; accepting again in %g s", exc.strerror, ACCEPT_RETRY_S)
                self.loop.remove_reader(self.sock.fileno())
                self.loop.call_later(ACCEPT_RETRY_S, self._resume)
                return
            connection.setblocking(False)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as asyncio: else ~40 ms a response
            self.handshake(connection)

    def _resume(self) -> None:
        if not self._closed:
            self.loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.loop.remove_reader(self.sock.fileno())

    async def wait_closed(self) -> None:
        return None


class Handshake:
    """One accepted socket until its TLS handshake ends. ``guard``: the guarded HTTP protocol class (its limit, its
    ``waiting`` and ``handshakes``); ``connections``: uvicorn's open connections (``server_state.connections``);
    ``http_protocol``: makes the protocol that takes the connection over."""

    def __init__(self, sock: socket.socket, guard: Any, connections: set[Any],
                 http_protocol: Callable[[], asyncio.Protocol], context: ssl.SSLContext, timeout_s: float) -> None:
        self.sock, self.guard, self.connections, self.http_protocol = sock, guard, connections, http_protocol
        self.accepted_at = asyncio.get_running_loop().time()  # the first request's header deadline counts from here
        guard.handshakes.add(self)
        guard.waiting[self] = None
        # False: none was waiting (every other connection has a request running). This one stays, and once its
        # handshake is done it is answered 503 as any connection over the limit, unless one waits or has gone by then.
        self.has_room = not over_limit(guard, connections) or close_longest_waiting(guard.waiting, self, guard.closing)
        self.task = asyncio.get_running_loop().create_task(self._handshake(context, timeout_s))

    def make_room(self) -> bool:
        """End the connection to make room (``close_longest_waiting``): it has sent no request. Its TLS layer, or
        the handshake about to begin, meets the end of the stream and closes the socket."""
        self._uncount()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed by its transport
            pass
        return True

    def _uncount(self) -> None:
        self.guard.handshakes.discard(self)
        self.guard.waiting.pop(self, None)

    def _taken_over(self, transport: asyncio.BaseTransport) -> None:
        """The handshake is done: the HTTP protocol takes the connection (``_HandOver``)."""
        self._uncount()  # before the HTTP protocol counts the connection itself
        protocol = self.http_protocol()
        protocol.opened_at = self.accepted_at  # type: ignore[attr-defined]  # the guard's header deadline
        protocol.has_room = self.has_room  # type: ignore[attr-defined]  # not counted a second time
        transport.set_protocol(protocol)
        protocol.connection_made(transport)

    async def _handshake(self, context: ssl.SSLContext, timeout_s: float) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: _HandOver(self), self.sock, ssl=context, ssl_handshake_timeout=timeout_s)
        except (OSError, ssl.SSLError, asyncio.TimeoutError):  # failed, timed out, or ended to make room: the
            pass  # socket is closed (the loop logs none of those either)
        finally:
            self._uncount()


class _HandOver(asyncio.Protocol):
    """The TLS layer's protocol for the moment its handshake is done: the TLS layer calls ``connection_made`` before
    it reads the first request (sent with the handshake's last message), which then goes to the HTTP protocol."""

    def __init__(self, handshake: Handshake) -> None:
        self.handshake = handshake

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.handshake._taken_over(transport)
