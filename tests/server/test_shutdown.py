"""Shutdown under load: the exit signal's handler of ``rerankit serve``'s uvicorn server (``DrainingServer``) on a
real uvicorn server; every request in flight is answered 200 or JSON 503, never a plain-text 500. The server runs
in a thread, so the test calls the signal handler itself (``benchmarks/serve_faults.py`` sends a real SIGTERM to a
``rerankit serve`` process). The backend answers its first engine call and holds every later one until it is told
to stop, so that work is certainly left at the drain deadline however fast the machine."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import uvicorn

from live_server import loopback_listener, serving
from server_fakes import RecordingBackend

from rerankit.errors import Cancelled
from rerankit.server.app import create_app
from rerankit.server.limits import ServerConfig
from rerankit.server.shutdown import GRACE_AFTER_DRAIN_S, DrainingServer

CLIENTS = 32
DRAIN_S = 0.3
DOCS = 8


class FirstCallOnly(RecordingBackend):
    """Scores its first engine call; holds each later one until ``should_stop`` says so."""

    def score_batch(self, requests, *, return_exceptions=False, should_stop=None):
        first = not self.calls
        self._record(requests)
        while not first and not (should_stop is not None and should_stop()):
            time.sleep(0.01)
        if not first:
            raise Cancelled("stopped")
        return [self._respond(request) for request in requests]


async def send_then_exit(url: str, server: DrainingServer) -> list[httpx.Response | Exception]:
    body = {"query": "which document talks about the sea", "documents": [f"document {n}" for n in range(DOCS)]}
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=CLIENTS)) as client:
        first = await client.post("/rerank", json=body)  # the engine's first call: answered
        sent = [asyncio.create_task(client.post("/rerank", json=body)) for _ in range(CLIENTS - 1)]
        await asyncio.sleep(0.3)  # every request sent, held by the engine or queued behind it
        server.handle_exit(signal.SIGTERM, None)
        return [first, *await asyncio.gather(*sent, return_exceptions=True)]


def test_exit_signal_drains_then_answers_what_is_left_with_a_json_503():
    listener = loopback_listener()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    app = create_app(FirstCallOnly(), ServerConfig(drain_seconds=DRAIN_S))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=DRAIN_S + GRACE_AFTER_DRAIN_S)
    server = DrainingServer(config, app.state.batcher, DRAIN_S)
    with serving(server, listener) as thread:
        replies = asyncio.run(send_then_exit(url, server))
        thread.join(20)
        assert not thread.is_alive(), "the server did not exit"
    statuses = [reply.status_code if isinstance(reply, httpx.Response) else repr(reply) for reply in replies]
    assert set(statuses) <= {200, 503}, statuses
    assert 200 in statuses and 503 in statuses, statuses
    for reply in replies:
        assert len(reply.json()["results"]) == DOCS if reply.status_code == 200 else (
            "shutting down" in reply.json()["error"]["message"] and reply.headers["retry-after"])


def test_an_exit_signal_during_the_warm_up_is_not_followed_by_ready(caplog, monkeypatch):
    """SIGTERM while the app starts (the warm-up): "draining" is logged, then no "ready on" for a server that stops."""
    async def warm_up_interrupted(self, sockets=None):
        self.handle_exit(signal.SIGTERM, None)  # the signal arrives during the app's start
        self.started = True

    monkeypatch.setattr(uvicorn.Server, "startup", warm_up_interrupted)
    app = create_app(RecordingBackend(), ServerConfig(drain_seconds=DRAIN_S))
    config = uvicorn.Config(app)
    config.load()  # as uvicorn's serve() does before startup()
    server = DrainingServer(config, app.state.batcher, DRAIN_S)
    with caplog.at_level("INFO", logger="rerankit.server"):
        asyncio.run(server.startup([loopback_listener()]))
    assert server.should_exit and "ready on" not in caplog.text
