"""Over ``max_connections`` over HTTPS, one newcomer makes one connection give way at the most, and a connection that
has given way is neither counted nor picked again while its socket is still open (``server/connections.py``,
``server/handshakes.py``).

The guarded uvicorn protocol and the ``Handshake`` of an accepted socket are driven by hand on fake TLS transports,
so that the order of events is fixed: a TLS handshake may end before the loop has delivered the ``connection_lost``
of a connection aborted to make room for it (asyncio delivers it two turns after the abort), and a client that
never answers the close_notify keeps its socket open for ``TLS_CLOSE_WAIT_S``.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from rerankit.server.connections import guarded_protocol
from rerankit.server.handshakes import Handshake
from rerankit.server.limits import ServerConfig


class TlsTransport(asyncio.Transport):
    """A TLS connection's transport: ``close()`` sends a close_notify and waits for the client's (which this client
    never sends); ``abort()`` lets the socket go, the protocol hearing of it on a later turn of the loop."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self.port, self.protocol, self.closed, self.aborted = port, None, False, False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sslcontext": True, "peername": ("127.0.0.1", self.port),
                "sockname": ("127.0.0.1", 8443)}.get(name, default)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        if not self.aborted:
            self.closed = self.aborted = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def get_write_buffer_size(self) -> int:
        return 0

    def write(self, data: bytes) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol


class Server:
    """The guarded protocol of a server with ``max_connections``, its open connections, and the newcomers' sockets."""

    def __init__(self, max_connections: int) -> None:
        config = ServerConfig(max_connections=max_connections, header_timeout_s=60, warm_up=False)

        async def app(scope, receive, send) -> None:  # never called: no request is sent
            raise AssertionError(scope)

        self.guard = guarded_protocol(config)
        self.uvicorn_config = uvicorn.Config(app, http=self.guard, log_config=None)
        self.state = ServerState()
        self.ports = iter(range(40000, 41000))
        self.sockets: list[socket.socket] = []
        self.handshakes: list[Handshake] = []

    def protocol(self) -> asyncio.Protocol:
        return self.guard(config=self.uvicorn_config, server_state=self.state, app_state={},
                          _loop=asyncio.get_running_loop())

    def connected(self) -> Any:
        """A TLS connection whose handshake is done and that waits for a request (counted at accept)."""
        return self.accepted().done()

    def accepted(self) -> "Newcomer":
        """A socket just accepted: its handshake begins, counted against the limit."""
        server_end, client_end = socket.socketpair()
        self.sockets += [server_end, client_end]
        handshake = Handshake(server_end, self.guard, self.state.connections, self.protocol,
                              ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), 60)
        self.handshakes.append(handshake)
        return Newcomer(handshake, next(self.ports))

    def open_count(self) -> int:
        return len(self.state.connections) + len(self.guard.handshakes)

    def close(self) -> None:
        for handshake in self.handshakes:
            handshake.task.cancel()
        for sock in self.sockets:
            sock.close()


class Newcomer:
    def __init__(self, handshake: Handshake, port: int) -> None:
        self.handshake, self.port = handshake, port

    def done(self) -> Any:
        """Its TLS handshake ends: the guarded protocol takes the connection over, as ``_HandOver`` has it do."""
        transport = TlsTransport(self.port)
        self.handshake._taken_over(transport)
        return transport.protocol


def is_closed(connection: Any) -> bool:
    return connection.transport.is_closing()


@pytest.fixture
async def server():
    made = Server(max_connections=2)
    yield made
    made.close()
    await asyncio.sleep(0)  # the handshakes' tasks end


async def test_one_newcomer_makes_one_connection_give_way_though_the_one_let_go_is_not_yet_gone(server):
    """A connection the server closed (its keep-alive timeout passed) gives way at the newcomer's accept; the
    newcomer's handshake ends before that connection is gone: it must not be counted again then, and no other
    connection must go for the same newcomer."""
    closed, waiting = server.connected(), server.connected()
    closed.timeout_keep_alive_handler()  # closed by the server; its client never answers the close_notify
    newcomer = server.accepted()
    assert closed.transport.aborted  # gave way at the accept, at once
    connection = newcomer.done()  # before the loop delivers the abort
    assert not is_closed(waiting), "a second connection gave way to one newcomer"
    assert connection.app is not server.guard.over_capacity
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert server.state.connections == {waiting, connection}


async def test_a_connection_that_gave_way_is_not_picked_again_nor_counted(server):
    """The connection closed to make room keeps its socket while it waits for the close_notify: the newcomer's
    handshake ending then does not let it go early (it keeps its 1 s for a clean close); the next newcomer makes
    the next connection give way; and once one of those left, a newcomer finds room without closing anything."""
    first, second = server.connected(), server.connected()
    newcomer = server.accepted()
    assert is_closed(first) and not first.transport.aborted  # its close_notify is sent
    third = newcomer.done()
    assert not first.transport.aborted, "the connection that gave way was picked again"
    assert not is_closed(second)

    fourth = server.accepted().done()
    assert is_closed(second) and not second.transport.aborted and not is_closed(third)
    assert fourth.app is not server.guard.over_capacity

    third.connection_lost(None)  # its client left; the two that gave way are still open
    assert server.open_count() == 3
    fifth = server.accepted().done()
    assert not is_closed(fourth), "a connection that gave way was counted against the limit"
    assert {fourth, fifth} <= server.state.connections
