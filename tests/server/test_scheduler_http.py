"""Work follows the caller over HTTP, the per-request token limit and the draining server's 503, on real routes;
and the engine's ``should_stop`` hook on a tiny model."""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx
import pytest

from live_server import live_server
from server_fakes import RecordingBackend

from rerankit.errors import Cancelled, RemoteError, ReplicaDied
from rerankit.schema import ScoreRequest
from rerankit.server.app import create_app
from rerankit.server.limits import ServerConfig

BODY = b'{"query": "q", "documents": ["one", "two", "three"]}'


def metric(url: str, name: str) -> float:
    page = httpx.get(url + "/metrics", timeout=5).text
    found = re.search(rf"^{name} (\S+)$", page, re.M)
    return float(found.group(1)) if found else 0.0


def wait_for(condition, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def raw_post(url: str, body: bytes, declared: int | None = None) -> socket.socket:
    """Send a POST /rerank over a plain socket (``declared``: a Content-Length other than the body's)."""
    host, port = url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)), timeout=5)
    head = (f"POST /rerank HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared if declared is not None else len(body)}\r\n\r\n").encode()
    connection.sendall(head + body)
    return connection


def test_clients_that_leave_are_cancelled_not_scored_and_never_counted_as_errors():
    backend = RecordingBackend(hold_first_call=True)
    with live_server(create_app(backend, ServerConfig(batch_window_ms=1))) as url:
        first = threading.Thread(target=lambda: httpx.post(url + "/rerank", json={
            "query": "first", "documents": ["a"]}, timeout=20))
        first.start()
        assert backend.entered.wait(10)
        raw_post(url, b'{"query": "gone", "documents": ["a", "b"]}').close()  # queued, then hangs up
        assert wait_for(lambda: metric(url, "rerankit_cancelled_total") == 1), "the queued request was not cancelled"
        raw_post(url, BODY[:10], declared=len(BODY)).close()  # hangs up halfway through its body
        assert wait_for(lambda: metric(url, "rerankit_cancelled_total") == 2), "the cut body was not a cancel"
        backend.gate.set()
        first.join(20)
        page = httpx.get(url + "/metrics", timeout=5).text
    assert ["gone"] not in backend.calls and backend.calls[0] == ["first"]
    assert 'status="500"' not in page and 'status="499"' not in page


def test_request_over_max_request_tokens_is_a_413_in_the_routes_dialect():
    with live_server(create_app(RecordingBackend(), ServerConfig(max_request_tokens=50))) as url:
        reply = httpx.post(url + "/v2/rerank", json={"query": "q", "documents": ["x" * 400]}, timeout=10)
    assert reply.status_code == 413
    assert "max_request_tokens" in reply.json()["message"]  # Cohere's error body: {"message": ...}


async def test_a_draining_server_answers_new_work_with_a_json_503_and_retry_after():
    app = create_app(RecordingBackend(), ServerConfig(retry_after_s=3))
    await app.state.batcher.drain(0)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        cohere = await client.post("/v2/rerank", json={"query": "q", "documents": ["a"]})
        vllm = await client.post("/rerank", json={"query": "q", "documents": ["a"]})
    assert cohere.status_code == vllm.status_code == 503
    assert cohere.headers["retry-after"] == "3"
    assert "shutting down" in cohere.json()["message"]
    assert vllm.json()["error"]["code"] == 503


def test_the_engine_stops_between_micro_batches_when_asked(ce):
    backend, budget = ce, ce.max_batch_tokens
    backend.max_batch_tokens = 64  # a micro-batch of a few pairs
    request = ScoreRequest(query="a query of a few words",
                           items=[f"document number {n} about things" for n in range(40)])
    asked = []

    def stop_after_two() -> bool:
        asked.append(True)
        return len(asked) > 2

    try:
        with pytest.raises(Cancelled):
            backend.score_batch([request], should_stop=stop_after_two)
        assert len(asked) == 3  # asked before each micro-batch: two ran, the third was not started
        assert len(backend.score_batch([request], should_stop=lambda: False)[0].results) == 40
    finally:
        backend.max_batch_tokens = budget


@pytest.mark.parametrize("error", [ReplicaDied("replica 1 died"), RemoteError("busy", 503, "http://far/rerank"),
                                   RemoteError("slow down", 429, "http://far/rerank")])
async def test_every_429_and_503_carries_retry_after(error):
    class Failing(RecordingBackend):
        def score(self, request):
            raise error

    app = create_app(Failing(), ServerConfig(retry_after_s=4))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            reply = await client.post("/v2/rerank", json={"query": "q", "documents": ["a"]})
    assert reply.status_code == error.status_code
    assert reply.headers["retry-after"] == "4"


async def test_a_draining_server_refuses_before_reading_the_body():
    app = create_app(RecordingBackend(), ServerConfig())
    await app.state.batcher.drain(0)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        reply = await client.post("/v2/rerank", content=b"{not json", headers={"content-type": "text/plain"})
    assert reply.status_code == 503  # not the 415 or 400 that reading and parsing it would give
    assert "shutting down" in reply.json()["message"]
