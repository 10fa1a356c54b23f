"""Request ids across servers: a proxy (``rerankit serve --model http://far``) sends its request's id to the far
server as ``X-Request-Id``, a chain of proxies keeps one id end to end, and the remote client used from code of its
own sends the id the caller set."""

from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
from live_server import live_server

from rerankit.remote import RemoteBackend
from rerankit.request_ids import REQUEST_ID
from rerankit.schema import ScoreRequest
from rerankit.server.app import create_app
from rerankit.server.limits import ServerConfig

BODY = {"model": "fault-model", "query": "q", "items": ["doc 0", "doc 1", "doc 2"], "label_token_ids": [1, 2]}
GENERATED = re.compile(r"[0-9a-f]{32}")


def far_ids(far) -> list[str | None]:
    """The ``X-Request-Id`` of each POST the far server got."""
    return [headers.get("x-request-id") for headers, _ in far.posts]


def proxy_of(stack: ExitStack, far_url: str, **options) -> str:
    """The URL of a proxy to ``far_url`` speaking vllm-generative, until ``stack`` closes."""
    backend = RemoteBackend(far_url, dialect="vllm-generative", served_model="fault-model", **options)
    stack.callback(backend.close)
    return stack.enter_context(live_server(create_app(backend, ServerConfig(batch_window_ms=0))))


def test_a_proxy_sends_the_clients_id_on_every_far_request_of_that_request(servers):
    far = servers()
    with ExitStack() as stack:
        url = proxy_of(stack, far.url, max_items_per_request=1)  # the request goes as 3 far requests
        reply = httpx.post(url + "/generative_scoring", json=BODY, headers={"X-Request-Id": "client-1"}, timeout=10)
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "client-1"
    assert far_ids(far) == ["client-1"] * 3


def test_a_proxy_sends_the_id_it_made_when_the_client_sent_none(servers):
    far = servers()
    with ExitStack() as stack:
        url = proxy_of(stack, far.url)
        replies = [httpx.post(url + "/generative_scoring", json=BODY, timeout=10,
                              headers={"X-Request-Id": "bad\tid"} if bad else None) for bad in (False, True)]
    made = [reply.headers["x-request-id"] for reply in replies]
    assert all(GENERATED.fullmatch(request_id) for request_id in made) and far_ids(far) == made


def test_concurrent_clients_ids_reach_the_far_server_each_with_its_own_request(servers):
    far = servers(delays=(0.0, 0.05))

    def send(url: str, number: int) -> httpx.Response:
        body = {**BODY, "query": f"q{number}"}
        return httpx.post(url + "/generative_scoring", json=body, headers={"X-Request-Id": f"c{number}"}, timeout=20)

    with ExitStack() as stack:
        url = proxy_of(stack, far.url)
        with ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(lambda number: send(url, number), range(16)))
    assert [reply.headers["x-request-id"] for reply in replies] == [f"c{number}" for number in range(16)]
    assert sorted((headers["x-request-id"], body["query"]) for headers, body in far.posts) == sorted(
        (f"c{number}", f"q{number}") for number in range(16))


def test_a_chain_of_proxies_keeps_one_id_end_to_end(servers):
    far = servers()
    with ExitStack() as stack:
        inner = proxy_of(stack, far.url)
        outer = proxy_of(stack, inner)
        given = httpx.post(outer + "/generative_scoring", json=BODY, headers={"X-Request-Id": "chain-9"}, timeout=10)
        made = httpx.post(outer + "/generative_scoring", json=BODY, timeout=10)
    assert given.status_code == made.status_code == 200
    assert given.headers["x-request-id"] == "chain-9"
    assert far_ids(far) == ["chain-9", made.headers["x-request-id"]]


def test_a_proxys_502_log_line_names_the_request_id(servers, caplog):
    far = servers(default="500")
    with caplog.at_level(logging.WARNING, logger="rerankit.server"), ExitStack() as stack:
        url = proxy_of(stack, far.url, max_retries=0)
        reply = httpx.post(url + "/generative_scoring", json=BODY, headers={"X-Request-Id": "far-fail"}, timeout=10)
    assert reply.status_code == 502 and reply.headers["x-request-id"] == "far-fail"
    assert far_ids(far) == ["far-fail"]
    assert any(record.getMessage().startswith("proxied request far-fail on /generative_scoring failed")
               for record in caplog.records), caplog.text


def test_the_remote_client_used_from_code_sends_the_id_its_caller_set(servers):
    far = servers()
    request = ScoreRequest(query="q", items=["doc 0", "doc 1", "doc 2"], label_token_ids=[1, 2])
    with RemoteBackend(far.url, dialect="vllm-generative", served_model="fault-model",
                       max_items_per_request=1) as backend:
        backend.score(request)  # no id set: none sent
        token = REQUEST_ID.set("mine")
        try:
            backend.score(request)  # three bodies, sent from worker threads
        finally:
            REQUEST_ID.reset(token)
    assert far_ids(far) == [None] * 3 + ["mine"] * 3
