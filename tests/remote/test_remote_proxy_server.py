"""``rerankit serve --model http://...`` (a ``RemoteBackend`` behind the server) against a real far server on
loopback: a client that leaves takes its request to the far server with it."""

from __future__ import annotations

import time

import httpx
from live_server import live_server

from rerankit.remote import RemoteBackend
from rerankit.server.app import create_app
from rerankit.server.limits import ServerConfig

BODY = {"model": "fault-model", "query": "q", "items": ["doc 0", "doc 1"], "label_token_ids": [1, 2]}


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_a_client_that_leaves_closes_the_proxied_request_to_the_far_server(servers):
    far = servers(default="hold")  # never answers: only a closed connection ends its handler
    backend = RemoteBackend(far.url, dialect="vllm-generative", served_model="fault-model", max_retries=0)
    with live_server(create_app(backend, ServerConfig(served_model_name="proxy"))) as url:
        try:
            httpx.post(f"{url}/generative_scoring", json=BODY, timeout=httpx.Timeout(5.0, read=0.5))
        except httpx.ReadTimeout:
            pass  # the client gives up and closes its connection
        # the far request is closed within moments, not at the remote client's 120 s deadline
        assert wait_for(lambda: far.abandoned == 1, 5.0), (far.hits, far.in_flight)
        assert wait_for(lambda: far.in_flight == 0, 2.0)
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
    assert far.hits == 1
    assert "rerankit_cancelled_total 1" in metrics and "rerankit_batches_stopped_total 1" in metrics


def test_a_proxied_request_whose_client_stays_is_answered(servers):
    far = servers()
    backend = RemoteBackend(far.url, dialect="vllm-generative", served_model="fault-model")
    with live_server(create_app(backend, ServerConfig(served_model_name="proxy"))) as url:
        reply = httpx.post(f"{url}/generative_scoring", json=BODY, timeout=10)
    assert reply.status_code == 200, reply.text
    assert [row["score"] for row in sorted(reply.json()["data"], key=lambda row: row["index"])] == [0.0, 0.001]
