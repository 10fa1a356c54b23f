"""The uvicorn server of ``rerankit serve``: it logs when it is ready, and its exit signal first drains the batcher."""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn

from rerankit.server.batcher import Batcher
from rerankit.server.connections import address

log = logging.getLogger("rerankit.server")

GRACE_AFTER_DRAIN_S = 5  # uvicorn's own graceful-shutdown timeout is the drain time plus this: it never cancels work
STARTUP_FAILURE = 3  # uvicorn's exit status when the server did not start


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM/SIGINT also starts ``batcher.drain(drain_seconds)``.

    uvicorn then stops accepting connections and waits for the requests in progress; the drain answers them all
    (scores, or a JSON 503 once ``drain_seconds`` have passed) before uvicorn's own timeout, which is longer, would
    cancel a request and write its plain-text 500. A second SIGINT still forces uvicorn out at once.
    """

    def __init__(self, config: uvicorn.Config, batcher: Batcher, drain_seconds: float) -> None:
        super().__init__(config)
        self.batcher = batcher
        self.drain_seconds = drain_seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Future | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)  # the app's start (the warm-up), then listening on ``sockets``
        if self.started:
            listener = (sockets or [server.sockets[0] for server in self.servers])[0]
            scheme = "https" if self.config.is_ssl else "http"
            log.info("ready on %s://%s", scheme, address(self.config.host, listener.getsockname()[1]))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is not None and self._drain is None:
            self._loop.call_soon_threadsafe(self._start_drain)
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self.batcher.drain(self.drain_seconds))
