"""A client that starts before its server, as in a docker-compose or Kubernetes deployment: discovery waits for the
server as a scoring call's tries do (the same ``max_retries``, backoff, ``Retry-After`` and deadline), sync and
async, against ``rerankit serve`` refusing connections while it warms up and against a server answering 503 before
it is ready (fault_server.py); a definite refusal (401, 403, 404) is not waited for, and nothing a starting server
answers is cached."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from fault_server import expected_scores, items
from live_server import PromptServer, live_server, loopback_listener
from server_fakes import RecordingBackend

import rerankit
from rerankit import Reranker
from rerankit.errors import Cancelled, RemoteError
from rerankit.remote import RemoteBackend, Timeout
import rerankit.remote.discover as discovery
from rerankit.schema import ScoreRequest
from rerankit.server.app import create_app
from rerankit.server.connections import uvicorn_config
from rerankit.server.limits import ServerConfig

# Short waits between tries, and as many tries as the deadline allows: a call waits for its server up to the deadline.
PATIENT = {"timeout": Timeout(connect=0.5, read=2.0), "backoff_base": 0.05, "backoff_max": 0.1, "max_retries": 1000}
SLACK = 0.4  # timers, thread switches and a loaded 2-core box
LABELS = {"label_token_ids": [1, 2]}  # vLLM's /generative_scoring, the fault server's scoring route


@pytest.fixture(autouse=True)
def fresh_discovery():
    discovery.forget()
    yield
    discovery.forget()


async def score(backend: RemoteBackend, use_async: bool, count: int = 3, **fields):
    request = ScoreRequest(query="q", items=items(count), **fields)
    try:
        return await backend.ascore(request) if use_async else backend.score(request)
    finally:
        if use_async:
            await backend.aclose()
        else:
            backend.close()


class WarmingUp(RecordingBackend):
    """A backend whose warm-up takes ``seconds``: ``rerankit serve`` listens only once it is over."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def warm_up(self) -> float:
        time.sleep(self.seconds)
        return self.seconds


@contextmanager
def starting_server(warm_up_seconds: float) -> Iterator[str]:
    """``rerankit serve``'s app and server, started now: its port is bound at once, but refuses connections until
    the warm-up is over (as ``rerankit serve`` and vLLM do). Yields the URL without waiting."""
    listener = loopback_listener()
    app = create_app(WarmingUp(warm_up_seconds), ServerConfig(batch_window_ms=0))
    server = PromptServer(uvicorn_config(app, ServerConfig(), lifespan="on", log_level="warning",
                                         timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        server.wake()
        thread.join(10)
        listener.close()


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_a_client_made_before_its_server_listens_scores_once_it_is_up(use_async):
    with starting_server(0.5) as url:
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=1)  # not up yet
        started = time.monotonic()
        response = await score(RemoteBackend(url, deadline=10, **PATIENT), use_async, count=3)
        took = time.monotonic() - started
    assert response.scores == [float(len(item)) for item in items(3)]  # the warming backend scores by length
    assert 0.2 < took < 0.5 + 1.0


def test_a_client_started_beside_rerankit_serve_ranks_once_it_is_ready():
    """A real ``rerankit serve`` process (a proxy, which needs no model) and a client started at the same moment."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(rerankit.__file__).parents[1])}
    env.pop("RERANKIT_API_KEY", None)
    with live_server(create_app(RecordingBackend(), ServerConfig(batch_window_ms=0))) as far:
        process = subprocess.Popen([sys.executable, "-m", "rerankit", "serve", "--model", far, "--port", str(port),
                                    "--served-model-name", "front", "--log-level", "warning"], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)  # not up yet
            ranked = Reranker(f"http://127.0.0.1:{port}", deadline=30, **PATIENT).rank("q", ["a", "ccc", "bb"])
        finally:
            process.terminate()
            _, errors = process.communicate(timeout=10)
    assert [document.text for document in ranked] == ["ccc", "bb", "a"], errors


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_discovery_asks_a_server_answering_503_again_when_its_retry_after_says(servers, use_async):
    far = servers()
    far.probes = deque(["503:0.2"] * 3)  # one round of probes, each asking to come back in 0.2 s
    started = time.monotonic()
    # Without Retry-After, the first retry would wait 5 to 10 s: past the deadline, so the call would fail.
    response = await score(RemoteBackend(far.url, deadline=5, backoff_base=10.0, backoff_max=10.0), use_async,
                           **LABELS)
    assert time.monotonic() - started < 0.2 + SLACK + 0.5
    assert response.scores == expected_scores(3)
    assert far.gets == ["/openapi.json", "/v1/models", "/info", "/openapi.json", "/v1/models"]
    assert [body for _, body in far.posts][0]["model"] == "fault-model"


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_a_server_still_starting_at_the_deadline_fails_naming_its_url_status_and_the_time_waited(servers,
                                                                                                    use_async):
    far = servers()
    far.probes = deque(["503"] * 1000)
    started = time.monotonic()
    with pytest.raises(RemoteError) as error:
        await score(RemoteBackend(far.url, deadline=0.6, **PATIENT), use_async)
    took = time.monotonic() - started
    message = str(error.value)
    assert message.startswith(f"HTTP 503 from {far.url}: every discovery probe (/openapi.json, /v1/models, /info) "
                              "got 503, "), message
    assert " tries in 0." in message and "(deadline 0.6 s): is the server still starting?" in message, message
    assert error.value.status_code == 503 and error.value.url == far.url
    assert 0.4 < took < 0.6 + SLACK
    assert len(far.gets) > 6 and far.posts == []


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_a_deadline_that_passes_during_a_probe_still_names_the_last_status(servers, use_async):
    far = servers()
    far.probes = deque(["503"] * 3 + ["hang"])  # a round of 503s, then no answer until the deadline
    started = time.monotonic()
    with pytest.raises(RemoteError) as error:
        await score(RemoteBackend(far.url, deadline=0.4, **PATIENT), use_async)
    expected = (rf"HTTP 503 from {far.url}: every discovery probe \(/openapi.json, /v1/models, /info\) got 503, "
                r"2 tries in 0\.\d s \(deadline 0\.4 s\): is the server still starting\?")
    assert re.match(expected, str(error.value)), str(error.value)
    assert time.monotonic() - started < 0.4 + SLACK


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_a_server_that_never_comes_up_fails_once_the_retries_are_spent(dead_url, use_async):
    started = time.monotonic()
    with pytest.raises(RemoteError) as error:
        await score(RemoteBackend(dead_url, max_retries=2, backoff_base=0.01), use_async)
    message = str(error.value)
    assert message.startswith(f"cannot reach {dead_url} to discover its dialect (ConnectError: "), message
    assert ", 3 tries in 0." in message and "(max_retries=2): is the server up?" in message, message
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("status", ["401", "403", "404"])
def test_a_definite_refusal_is_not_retried(servers, status):
    far = servers()
    far.probes = deque([status] * 100)
    with pytest.raises(RemoteError) as error:
        RemoteBackend(far.url, backoff_base=0.5).score(ScoreRequest(query="q", items=items(2)))
    assert error.value.status_code == int(status) and " tries in " not in str(error.value)
    assert far.gets == ["/openapi.json", "/v1/models", "/info"], "one round of probes, no wait"


async def test_a_model_asked_while_the_server_starts_is_asked_again_later(servers):
    """What a proxy does as it starts (``aserved_model``) and at each of its /v1/models: a starting far server's 503
    is not remembered as "it names no model"."""
    far = servers()
    far.probes = deque(["503"])
    backend = RemoteBackend(far.url, dialect="vllm-generative")
    assert await backend.aserved_model() is None
    assert await backend.aserved_model() == "fault-model"
    assert far.gets == ["/v1/models", "/v1/models"]
    await backend.aclose()


def test_a_model_read_for_a_dialect_waits_for_the_server_too():
    """A dialect that needs the served model (Cohere's) reads it from /v1/models as the server comes up."""
    asked: list[str] = []

    def cohere_server(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.path == "/v1/models":
            if len(asked) <= 2:
                return httpx.Response(503, json={"message": "loading"})
            return httpx.Response(200, json={"object": "list", "data": [{"id": "rerank-v3.5"}]})
        documents = json.loads(request.content)
        assert documents["model"] == "rerank-v3.5"
        return httpx.Response(200, json={"results": [{"index": i, "relevance_score": 0.5}
                                                     for i in range(len(documents["documents"]))]})

    with RemoteBackend("http://cohere:8000", dialect="cohere", transport=httpx.MockTransport(cohere_server),
                       **PATIENT) as backend:
        response = backend.score(ScoreRequest(query="q", items=items(2)))
    assert response.scores == [0.5, 0.5] and asked == ["/v1/models"] * 3 + ["/v2/rerank"]


def test_routes_read_while_a_probe_failed_are_used_but_not_cached():
    """/openapi.json answered 503 while /v1/models named vLLM: the routes vLLM may have serve this backend, but the
    next one reads what the server publishes."""
    asked: list[str] = []

    def vllm(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.path == "/openapi.json":
            if asked.count("/openapi.json") == 1:
                return httpx.Response(503, json={"message": "loading"})
            return httpx.Response(200, json={"paths": {"/score": {}}})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "owned_by": "vllm"}]})
        return httpx.Response(200, json={"data": [{"index": 0, "score": 0.5}], "model": "m"})

    routes = []
    for _ in range(2):
        with RemoteBackend("http://vllm:8000", transport=httpx.MockTransport(vllm)) as backend:
            backend.score(ScoreRequest(query="q", items=items(1)))
            routes.append(backend._discovery.routes)
    assert routes == [(("vllm-generative", "/generative_scoring"), ("vllm-score", "/score")),
                      (("vllm-score", "/score"),)]
    assert asked.count("/openapi.json") == 2


async def test_cancelling_a_call_that_waits_for_its_server_ends_it_at_once(dead_url):
    backend = RemoteBackend(dead_url, deadline=30, **PATIENT)
    call = asyncio.ensure_future(backend.ascore(ScoreRequest(query="q", items=items(2))))
    await asyncio.sleep(0.3)
    assert not call.done(), "still waiting for the server"
    started = time.monotonic()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert time.monotonic() - started < 0.2
    assert discovery._cache == {} and discovery._model_cache == {}
    await backend.aclose()


@pytest.mark.parametrize("dialect", [None, "cohere", "tei"], ids=["discovery", "served model", "scoring tries"])
def test_closing_the_backend_wakes_a_sync_call_waiting_for_its_server(dead_url, dialect):
    """``close()`` from another thread ends a call waiting for a server that is not up -- between discovery's rounds
    (its dialect, or the model Cohere's dialect needs) or a scoring call's tries -- with an error saying so, not at
    its deadline: the waits here are 20 s, a minute in all."""
    backend = RemoteBackend(dead_url, dialect=dialect, deadline=60, timeout=Timeout(connect=0.5, read=2.0),
                            backoff_base=20, backoff_max=20, max_retries=1000)
    outcome, tried, exchange = [], threading.Event(), backend.transport._exchange

    def first_try(*args, **kwargs):
        tried.set()
        return exchange(*args, **kwargs)

    def call():
        try:
            outcome.append(backend.score(ScoreRequest(query="q", items=items(2))))
        except Exception as error:  # noqa: BLE001 - the test reads what came out
            outcome.append(error)

    backend.transport._exchange = first_try
    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    assert tried.wait(10), "the call never tried the server"
    backend.close()
    caller.join(10)
    assert not caller.is_alive(), "the call still waits after close()"
    assert isinstance(outcome[0], Cancelled), repr(outcome[0])
    assert str(outcome[0]) == "the remote backend was closed while this call ran"
    assert discovery._cache == {} and discovery._model_cache == {}
