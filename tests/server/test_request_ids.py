"""Request ids: every response of the server carries an ``X-Request-Id`` (the client's where usable, else a fresh
one), failed requests' log lines name it, and the batcher runs each proxied call under its caller's id."""

from __future__ import annotations

import asyncio
import logging
import re

import httpx
import pytest
from live_server import live_server
from server_fakes import RecordingBackend
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from rerankit.request_ids import MAX_LENGTH, REQUEST_ID, usable_request_id
from rerankit.schema import ScoreRequest, ScoreResponse
from rerankit.server.app import create_app
from rerankit.server.batcher import Batcher
from rerankit.server.connections import over_capacity_app
from rerankit.server.limits import ServerConfig
from rerankit.server.request_ids import RequestIds

RERANK = {"query": "q", "documents": ["a", "bb"]}
GENERATED = re.compile(r"[0-9a-f]{32}")
KEY = "test-key"


class FailingBackend(RecordingBackend):
    """Every engine call fails as a bug would."""

    def score(self, request: ScoreRequest) -> ScoreResponse:
        raise RuntimeError("boom")


@pytest.fixture(scope="module")
def url():
    config = ServerConfig(max_body_bytes=4096, batch_window_ms=0)
    with live_server(create_app(RecordingBackend(), config)) as base:
        yield base


@pytest.fixture(scope="module")
def keyed_url():
    with live_server(create_app(RecordingBackend(), ServerConfig(api_key=KEY))) as base:
        yield base


def test_the_clients_id_comes_back(url):
    reply = httpx.post(url + "/rerank", json=RERANK, headers={"X-Request-Id": "trace-42/a:b"}, timeout=10)
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "trace-42/a:b"
    assert reply.headers.get_list("x-request-id") == ["trace-42/a:b"]


def test_an_id_of_the_longest_length_allowed_comes_back(url):
    longest = "x" * MAX_LENGTH
    assert httpx.post(url + "/rerank", json=RERANK, headers={"X-Request-Id": longest},
                      timeout=10).headers["x-request-id"] == longest


def test_without_an_id_each_request_gets_a_fresh_one(url):
    ids = [httpx.post(url + "/rerank", json=RERANK, timeout=10).headers["x-request-id"] for _ in range(2)]
    assert all(GENERATED.fullmatch(request_id) for request_id in ids) and ids[0] != ids[1]


@pytest.mark.parametrize("given", ["x" * (MAX_LENGTH + 1), "a\tb", "with space", b"caf\xe9", ""])
def test_an_unusable_id_is_replaced_never_echoed(url, given):
    reply = httpx.post(url + "/rerank", json=RERANK, headers={"X-Request-Id": given}, timeout=10)
    assert reply.status_code == 200 and GENERATED.fullmatch(reply.headers["x-request-id"])


def test_usable_ids_are_visible_ascii_of_at_most_128_characters():
    assert usable_request_id("abc-DEF_123.~!") == "abc-DEF_123.~!" and usable_request_id(b"abc") == "abc"
    for bad in (None, "", "a\nb", "a\x00", "\x7f", "é", "x" * 129):
        assert usable_request_id(bad) is None, bad


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/rerank", b"{not json", 400),
    ("POST", "/rerank", b'{"query": "q", "documents": "' + b"a" * 5000 + b'"}', 413),
    ("GET", "/no/such/path", None, 404),
    ("GET", "/rerank", None, 405),
    ("GET", "/health", None, 200),
    ("GET", "/metrics", None, 200),
])
def test_every_answer_carries_the_id(url, method, path, body, status):
    headers = {"X-Request-Id": "req-1", "Content-Type": "application/json"}
    reply = httpx.request(method, url + path, content=body, headers=headers, timeout=10)
    assert reply.status_code == status and reply.headers["x-request-id"] == "req-1"


def test_a_415_carries_the_id(url):
    reply = httpx.post(url + "/rerank", content=b"{}", headers={"X-Request-Id": "r415", "Content-Type": "text/plain"},
                       timeout=10)
    assert reply.status_code == 415 and reply.headers["x-request-id"] == "r415"


def test_a_401_carries_the_id_and_open_pages_too(keyed_url):
    reply = httpx.post(keyed_url + "/rerank", json=RERANK, headers={"X-Request-Id": "no-key"}, timeout=10)
    assert reply.status_code == 401 and reply.headers["x-request-id"] == "no-key"
    models = httpx.get(keyed_url + "/v1/models", timeout=10)
    assert models.status_code == 401 and GENERATED.fullmatch(models.headers["x-request-id"])
    keyed = httpx.post(keyed_url + "/rerank", json=RERANK, timeout=10,
                       headers={"X-Request-Id": "with-key", "Authorization": f"Bearer {KEY}"})
    assert keyed.status_code == 200 and keyed.headers["x-request-id"] == "with-key"


def test_a_failed_request_is_a_500_with_the_id_and_its_log_line_names_it(caplog):
    with caplog.at_level(logging.WARNING, logger="rerankit.server"), \
            live_server(create_app(FailingBackend(), ServerConfig(batch_window_ms=0))) as base:
        reply = httpx.post(base + "/rerank", json=RERANK, headers={"X-Request-Id": "bug-7"}, timeout=10)
    assert reply.status_code == 500 and reply.headers["x-request-id"] == "bug-7"
    lines = [record.getMessage() for record in caplog.records if "bug-7" in record.getMessage()]
    assert lines == ["scoring request bug-7 on /rerank failed"], caplog.text


def test_the_over_capacity_503_carries_the_id():
    refuse = TestClient(over_capacity_app(ServerConfig()))
    reply = refuse.post("/rerank", json=RERANK, headers={"X-Request-Id": "busy-1"})
    assert reply.status_code == 503 and reply.headers["x-request-id"] == "busy-1"
    assert GENERATED.fullmatch(refuse.get("/health").headers["x-request-id"])


def test_an_unhandled_error_is_a_500_with_the_id():
    async def broken(request: Request) -> None:
        raise RuntimeError("a bug")

    app = Starlette(routes=[Route("/broken", broken)], middleware=[Middleware(RequestIds)])
    reply = TestClient(app, raise_server_exceptions=False).get("/broken", headers={"X-Request-Id": "oops"})
    assert reply.status_code == 500 and reply.text == "Internal Server Error"
    assert reply.headers.get_list("x-request-id") == ["oops"]


class BrokenHealth:
    """A proxy-like backend whose far-server health check has a bug."""

    model_name = "broken-health"

    async def ascore(self, request: ScoreRequest) -> ScoreResponse:
        return await asyncio.to_thread(RecordingBackend().score, request)

    async def ahealth(self) -> str | None:
        raise RuntimeError("a bug in the health check")


def test_an_error_the_app_lets_through_is_a_json_500_naming_the_id(caplog):
    """The server's own answer to a bug outside the scoring routes' handlers: rerankit's JSON error body (never
    starlette's plain text), with the id in the header, the message and the log line."""
    with live_server(create_app(BrokenHealth(), ServerConfig())) as url:
        reply = httpx.get(f"{url}/health", headers={"X-Request-Id": "probe-7"}, timeout=5)
    assert reply.status_code == 500 and reply.headers["content-type"] == "application/json"
    assert reply.headers.get_list("x-request-id") == ["probe-7"]
    assert reply.json()["error"]["message"] == ("internal server error (request probe-7: the server's log has its "
                                                "traceback)")
    assert "request probe-7 on /health failed with an unhandled error" in caplog.text


def test_a_header_the_app_sets_itself_is_replaced():
    async def own(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok", headers={"X-Request-Id": "the-apps"})

    app = Starlette(routes=[Route("/own", own)], middleware=[Middleware(RequestIds)])
    reply = TestClient(app).get("/own", headers={"X-Request-Id": "the-clients"})
    assert reply.headers.get_list("x-request-id") == ["the-clients"]


class AsyncRecorder:
    """A proxy-like backend (``ascore``, no ``score_batch``) that records the request id each call runs under."""

    model_name = "async-recorder"

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, str]] = []

    async def ascore(self, request: ScoreRequest) -> ScoreResponse:
        await asyncio.sleep(0.01)  # calls overlap: several callers' calls in flight at once
        self.seen.append((REQUEST_ID.get(), request.query))
        return await asyncio.to_thread(RecordingBackend().score, request)


async def submit_as(batcher: Batcher, request_id: str | None, query: str) -> ScoreResponse:
    REQUEST_ID.set(request_id)  # this task's own context, as a route's
    return await batcher.submit(ScoreRequest(query=query, items=["a", "bb"]))


async def test_each_proxied_call_runs_under_its_own_callers_id():
    backend = AsyncRecorder()
    batcher = Batcher(backend, ServerConfig())
    batcher.start()
    try:
        await asyncio.gather(*(submit_as(batcher, f"id-{i}", f"q{i}") for i in range(12)),
                             submit_as(batcher, None, "anonymous"))
    finally:
        await batcher.stop()
    assert sorted(backend.seen, key=lambda seen: seen[1]) == sorted(
        [(f"id-{i}", f"q{i}") for i in range(12)] + [(None, "anonymous")], key=lambda seen: seen[1])
    assert REQUEST_ID.get() is None, "each caller's id stays in its own task"
