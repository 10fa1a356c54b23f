"""The uvicorn server of ``rerankit serve``: it logs when it is ready, and its exit signal first drains the batcher."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import ssl
from types import FrameType
from typing import Iterator

import uvicorn

from rerankit.server.batcher import Batcher
from rerankit.server.connections import address
from rerankit.server.handshakes import Handshake, TlsListener

log = logging.getLogger("rerankit.server")

GRACE_AFTER_DRAIN_S = 5  # uvicorn's own graceful-shutdown timeout is the drain time plus this: it never cancels work
STARTUP_FAILURE = 3  # uvicorn's exit status when the server did not start


def raise_exit_signals(signals: "list[int] | tuple[int, ...]") -> None:
    """Die of the signals that stopped the server (``DrainingServer.exit_signals``), as uvicorn would have, newest
    first; SIGINT excepted: ``serve()`` has always ended quietly on Ctrl-C."""
    for sig in reversed(signals):
        if sig != signal.SIGINT:
            signal.raise_signal(sig)


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM/SIGINT also starts ``batcher.drain(drain_seconds)``.

    uvicorn then stops accepting connections and waits for the requests in progress; the drain answers them all
    (scores, or a JSON 503 once ``drain_seconds`` have passed) before uvicorn's own timeout, which is longer, would
    cancel a request and write its plain-text 500. A second SIGINT still forces uvicorn out at once.
    """

    def __init__(self, config: uvicorn.Config, batcher: Batcher, drain_seconds: float,
                 handshake_timeout_s: float | None = None) -> None:
        super().__init__(config)
        self.batcher = batcher
        self.drain_seconds = drain_seconds
        self.handshake_timeout_s = handshake_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Future | None = None
        self.exit_signals: list[int] = []  # the signals that stopped it, for serve() to raise once it has cleaned up

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, except that the signals caught are not raised again as it ends: uvicorn raises them with the
        default handlers back, and SIGTERM's ends the process at once, before ``serve()`` closes the backend and
        sends the last batched spans. They are kept in ``exit_signals`` for ``serve()`` to raise afterwards."""
        with super().capture_signals():
            yield
            # uvicorn 0.29 on keeps them here; one without the attribute raises none again
            captured = getattr(self, "_captured_signals", None)
            if captured is not None:
                self.exit_signals, self._captured_signals = list(captured), []

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        tls = self.config.ssl
        if tls is None or not sockets or self.handshake_timeout_s is None:
            await super().startup(sockets)  # the app's start (the warm-up), then listening on ``sockets``
        else:
            await self._start_tls(sockets, tls)
        if self.started and not self.should_exit:  # an exit signal during the warm-up: stopping, not ready
            listener = (sockets or [server.sockets[0] for server in self.servers])[0]
            scheme = "https" if self.config.is_ssl else "http"
            log.info("ready on %s://%s", scheme, address(self.config.host, listener.getsockname()[1]))

    async def _start_tls(self, sockets: list[socket.socket], tls: ssl.SSLContext) -> None:
        """uvicorn's start with no socket to listen on, then ``sockets`` served over TLS by this process: each
        connection counted against the limit from its accept, its handshake bounded by ``handshake_timeout_s``
        (``handshakes.py``; uvicorn passes no bound, asyncio's default is 60 s). ``config``'s protocol is the
        connection guard's (``connections.uvicorn_config``)."""
        await super().startup([])
        if not self.started:
            return
        config, loop, guard = self.config, asyncio.get_running_loop(), self.config.http_protocol_class

        def http_protocol() -> asyncio.Protocol:
            return guard(config=config, server_state=self.server_state,  # as uvicorn's own
                         app_state=self.lifespan.state, _loop=loop)

        def handshake(connection: socket.socket) -> None:
            Handshake(connection, guard, self.server_state.connections, http_protocol, tls, self.handshake_timeout_s)

        self.servers.extend(TlsListener(sock, config.backlog, handshake) for sock in sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # A handshake done after uvicorn told the connections to close would open one that it then waits for.
        for handshake in list(getattr(self.config.http_protocol_class, "handshakes", ())):
            handshake.make_room()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is not None and self._drain is None:
            self._loop.call_soon_threadsafe(self._start_drain)
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self.batcher.drain(self.drain_seconds))
