"""The app's HTTP behaviour over a fake backend on a live loopback server: routing by body shape, auth,
limits, error formats, metrics, and the server pages. The real engine's round trips are in test_roundtrip.py.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from live_server import live_server
from server_fakes import RecordingBackend
from wire_models import ERROR_MODELS, VllmError

from rerankit.remote.dialects import DIALECTS
from rerankit.server.app import create_app
from rerankit.server.limits import ServerConfig
from rerankit.server.routes import ROUTES

GENERATIVE = {"query": "q", "items": ["a", "bb"], "label_token_ids": [1, 2]}


@pytest.fixture(scope="module")
def backend():
    return RecordingBackend()


@pytest.fixture(scope="module")
def url(backend):
    config = ServerConfig(max_body_bytes=4096, max_items_per_request=8, max_tokens_per_item=64)
    with live_server(create_app(backend, config)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, timeout=10) as client:
        yield client


def test_every_dialect_path_is_served():
    for dialect in DIALECTS.values():
        for path in dialect.paths:
            assert dialect.name in ROUTES[path], f"{dialect.name} speaks {path} but the server does not route it"


@pytest.mark.parametrize("path, body, shape", [
    ("/generative_scoring", GENERATIVE, "vllm-data"),
    ("/score", {"queries": "q", "documents": ["a", "bb"]}, "vllm-data"),
    ("/v1/score", {"query": "q", "items": ["a", "bb"], "label_token_ids": [1, 2]}, "sglang-scores"),
    ("/v1/score", {"text_1": "q", "text_2": ["a", "bb"]}, "vllm-data"),
    ("/rerank", {"query": "q", "documents": ["a", "bb"]}, "vllm-results"),
    ("/rerank", {"query": "q", "texts": ["a", "bb"]}, "tei-list"),
    ("/v1/rerank", {"query": "q", "documents": ["a", "bb"]}, "vllm-results"),
    ("/v1/rerank", {"query": "q", "documents": ["a", "bb"], "return_documents": False}, "sglang-list"),
    ("/v1/rerank", {"model": "m", "query": "q", "documents": ["a", "bb"], "return_documents": True}, "jina"),
    ("/v1/rerank", {"model": "m", "query": "q", "documents": ["a", "bb"], "return_documents": True,
                    "rank_fields": ["text"]}, "cohere"),
    ("/v2/rerank", {"model": "m", "query": "q", "documents": ["a", "bb"]}, "cohere"),
    ("/v2/rerank", {"query": "q", "documents": ["a", "bb"], "truncate_prompt_tokens": -1}, "vllm-results"),
])
def test_body_shape_picks_the_dialect_that_answers(client, path, body, shape):
    reply = client.post(path, json=body)
    assert reply.status_code == 200, reply.text
    payload = reply.json()
    if shape == "vllm-data":
        assert [entry["score"] for entry in payload["data"]] == [1.0, 2.0]
    elif shape == "sglang-scores":
        assert payload["object"] == "scoring" and payload["scores"] == [[1.0], [2.0]]
    elif shape == "vllm-results":
        assert [entry["index"] for entry in payload["results"]] == [1, 0] and "usage" in payload
    elif shape == "cohere":
        assert [entry["index"] for entry in payload["results"]] == [1, 0] and "meta" in payload
    elif shape == "jina":  # Jina's fields, within Cohere v1's (whose client may send the same body)
        assert sorted(payload) == ["id", "meta", "model", "results", "usage"] and payload["usage"] == {"total_tokens": 3}
        assert payload["meta"]["billed_units"] == {"search_units": 1} and payload["meta"]["api_version"] == {"version": "1"}
        assert [entry["document"] for entry in payload["results"]] == [{"text": "bb"}, {"text": "a"}]
    else:
        assert isinstance(payload, list) and [entry["index"] for entry in payload] == [1, 0]


@pytest.mark.parametrize("path", list(ROUTES))
def test_non_json_body_is_a_400_in_the_error_format_of_the_paths_first_dialect(client, path):
    reply = client.post(path, content=b"{not json", headers={"content-type": "application/json"})
    assert reply.status_code == 400
    ERROR_MODELS[ROUTES[path][0]].model_validate(reply.json())
    assert "JSON" in reply.text


def test_body_over_the_limit_is_a_413_and_the_server_keeps_serving(client):
    reply = client.post("/generative_scoring", json={**GENERATIVE, "items": ["x" * 5000]})
    assert reply.status_code == 413
    VllmError.model_validate(reply.json())
    assert "max_body_bytes" in reply.json()["error"]["message"]
    assert client.post("/generative_scoring", json=GENERATIVE).status_code == 200


def test_chunked_body_over_the_limit_is_refused_while_streaming(client):
    chunks = iter([b'{"query": "q", "items": ["', b"x" * 3000, b"y" * 3000, b'"]}'])
    reply = client.post("/generative_scoring", content=chunks, headers={"content-type": "application/json"})
    assert reply.status_code == 413


def test_too_many_items_is_a_413_naming_the_limit(client):
    reply = client.post("/rerank", json={"query": "q", "documents": ["d"] * 9})
    assert reply.status_code == 413
    assert reply.json()["error"]["param"] == "documents" and "max_items_per_request" in reply.json()["error"]["message"]


def test_token_limit_per_item_is_passed_to_the_engine_as_its_cut(client, backend):
    client.post("/rerank", json={"query": "limit-probe", "documents": ["d"]})
    client.post("/rerank", json={"query": "own-cut", "documents": ["d"], "max_tokens_per_doc": 10})
    sent = {request.query: request for request in backend.requests}
    assert sent["limit-probe"].max_tokens_per_item == 64
    assert sent["own-cut"].max_tokens_per_item == 10


def test_health_models_openapi_and_unknown_path(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["id"] == "recording"
    spec = client.get("/openapi.json").json()
    assert set(ROUTES) <= set(spec["paths"])
    assert client.get("/docs").status_code == 200
    missing = client.get("/no/such/path")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


def test_health_of_a_server_of_its_own_model_asks_no_far_server():
    class WithHealth(RecordingBackend):
        async def ahealth(self) -> str:
            raise AssertionError("only a proxy asks its backend about a far server")

    with live_server(create_app(WithHealth(), ServerConfig())) as base:
        reply = httpx.get(base + "/health", timeout=5)
    assert reply.status_code == 200 and reply.json() == {"status": "ok"}


def test_metrics_count_requests_items_tokens_and_latency(client):
    client.post("/score", json={"queries": "metrics", "documents": ["abc", "de"]})
    page = client.get("/metrics").text
    assert 'rerankit_requests_total{route="/score",status="200"}' in page
    assert 'rerankit_items_total{route="/score"}' in page
    assert 'rerankit_prompt_tokens_total{route="/score"}' in page
    assert 'rerankit_request_duration_seconds_bucket{route="/score",le="+Inf"}' in page
    assert "rerankit_queue_depth 0" in page
    assert "rerankit_batches_total" in page


def test_api_key_is_required_on_scoring_routes_only():
    with live_server(create_app(RecordingBackend(), ServerConfig(api_key="sesame"))) as url:
        with httpx.Client(base_url=url, timeout=10) as client:
            refused = client.post("/generative_scoring", json=GENERATIVE)
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == 401 and refused.headers["www-authenticate"] == "Bearer"
            wrong = client.post("/v1/score", json=GENERATIVE, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401 and wrong.json()["object"] == "error"
            assert client.get("/v1/models").status_code == 401
            assert client.get("/v1/models").headers["www-authenticate"] == "Bearer"
            granted = {"Authorization": "Bearer sesame"}
            assert client.post("/generative_scoring", json=GENERATIVE, headers=granted).status_code == 200
            assert client.get("/v1/models", headers=granted).status_code == 200
            assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_several_api_keys_are_each_taken_while_one_is_rotated():
    config = ServerConfig(api_key=("old-key", "new-key"))
    with live_server(create_app(RecordingBackend(), config)) as url:
        with httpx.Client(base_url=url, timeout=10) as client:
            def status(key: str) -> int:
                return client.post("/generative_scoring", json=GENERATIVE,
                                   headers={"Authorization": f"Bearer {key}"}).status_code

            assert status("old-key") == 200 and status("new-key") == 200
            assert status("new") == 401 and status("old-key,new-key") == 401 and status("old-key new-key") == 401


def test_full_queue_is_a_429_with_retry_after_and_the_server_recovers():
    backend = RecordingBackend(hold_first_call=True)
    with live_server(create_app(backend, ServerConfig(max_queue_requests=1))) as url:
        with httpx.Client(base_url=url, timeout=10) as client:
            def post() -> httpx.Response:
                return client.post("/generative_scoring", json=GENERATIVE)

            held = []
            first = threading.Thread(target=lambda: held.append(post()))
            first.start()
            assert backend.entered.wait(5)
            second = threading.Thread(target=lambda: held.append(post()))
            second.start()
            for _ in range(200):  # the second request has reached the queue
                if "rerankit_queue_depth 1" in client.get("/metrics").text:
                    break
                threading.Event().wait(0.01)
            refused = post()
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            assert "max_queue_requests" in refused.json()["error"]["message"]
            backend.gate.set()
            first.join(10)
            second.join(10)
            assert [reply.status_code for reply in held] == [200, 200]
            assert post().status_code == 200


def test_engine_failure_is_a_500_in_the_dialect_format_and_the_server_lives_on():
    class Broken(RecordingBackend):
        def score(self, request):
            if request.query == "explode":
                raise RuntimeError("boom")
            return super().score(request)

    with live_server(create_app(Broken(), ServerConfig())) as url:
        with httpx.Client(base_url=url, timeout=10) as client:
            reply = client.post("/v1/score", json={**GENERATIVE, "query": "explode"})
            assert reply.status_code == 500 and reply.json()["object"] == "error"
            assert "boom" not in reply.text
            assert client.post("/v1/score", json=GENERATIVE).status_code == 200


class WarmingBackend(RecordingBackend):
    """A backend with ``warm_up``, as the embedded engine has; it may fail."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.warm_ups = 0
        self.fail = fail

    def warm_up(self) -> float:
        self.warm_ups += 1
        if self.fail:
            raise RuntimeError("CUDA out of memory")
        return 0.0


def test_the_server_warms_the_engine_up_before_it_answers_unless_told_not_to(caplog):
    warming = WarmingBackend()
    with live_server(create_app(warming)) as base:
        assert warming.warm_ups == 1  # uvicorn accepts connections only after the lifespan's start-up
        assert httpx.get(base + "/health").status_code == 200
        assert warming.calls == []  # warming up is the backend's own business, not an engine call of the batcher
    cold = WarmingBackend()
    with live_server(create_app(cold, ServerConfig(warm_up=False))):
        assert cold.warm_ups == 0
    failing = WarmingBackend(fail=True)
    with caplog.at_level("WARNING", logger="rerankit.server"), live_server(create_app(failing)) as base:
        reply = httpx.post(base + "/rerank", json={"query": "q", "documents": ["a", "bb"]}, timeout=10)
        assert reply.status_code == 200 and failing.warm_ups == 1
    assert any("warm-up failed" in record.message and "CUDA out of memory" in record.message
               for record in caplog.records)


def test_the_server_freezes_what_is_alive_after_warming_up_when_told_to():
    import gc

    before = gc.get_freeze_count()
    warming = WarmingBackend()
    try:
        with live_server(create_app(warming, ServerConfig(freeze_gc=True))) as base:
            assert warming.warm_ups == 1 and gc.get_freeze_count() > before
            assert httpx.post(base + "/rerank", json={"query": "q", "documents": ["a"]}, timeout=10).status_code == 200
    finally:
        gc.unfreeze()
    with live_server(create_app(WarmingBackend())):
        assert gc.get_freeze_count() == 0  # the default leaves the caller's process alone
