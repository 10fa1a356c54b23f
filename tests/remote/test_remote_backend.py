"""RemoteBackend over httpx.MockTransport: what goes on the wire, splitting, discovery, errors, sync and async."""

from __future__ import annotations

import asyncio
import json
import math
import threading

import httpx
import pytest
from wire_models import REQUEST_MODELS

from rerankit import Reranker
from rerankit.errors import InvalidRequest, RemoteError
from rerankit.remote import RemoteBackend
from rerankit.remote.client import ClientConfig, Transport
from rerankit.remote.discover import forget
from rerankit.schema import ScoreRequest

DOCS = [f"document number {i}" for i in range(10)]


def doc_score(doc: str) -> float:
    """The fake servers' relevance: the document's number, scaled."""
    return int(doc.rsplit(" ", 1)[1]) / 100


class FakeServer:
    """Answers vLLM /generative_scoring and /score, SGLang /v1/score, the rerank routes and discovery probes."""

    def __init__(self, openapi_paths=(), models=None, info=None):
        self.requests: list[httpx.Request] = []
        self.openapi_paths = openapi_paths
        self.models = models
        self.info = info
        self._lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.requests.append(request)
        path = request.url.path
        if request.method == "GET":
            if path == "/openapi.json" and self.openapi_paths:
                return httpx.Response(200, json={"openapi": "3.1.0", "paths": {p: {} for p in self.openapi_paths}})
            if path == "/v1/models" and self.models:
                return httpx.Response(200, json={"object": "list", "data": self.models})
            if path == "/info" and self.info:
                return httpx.Response(200, json=self.info)
            return httpx.Response(404, json={"detail": "Not Found"})
        body = json.loads(request.content)
        if path in ("/generative_scoring", "/score"):
            items = body.get("items") or body.get("documents")
            data = [{"index": i, "object": "score", "score": doc_score(doc)} for i, doc in enumerate(items)]
            return httpx.Response(200, json={"id": "s", "object": "list", "created": 0, "model": "served",
                                             "data": data, "usage": {"prompt_tokens": 7 * len(items)}})
        if path == "/v1/score":
            scores = [[doc_score(doc), 1 - doc_score(doc)] for doc in body["items"]]
            return httpx.Response(200, json={"scores": scores, "model": "served", "object": "scoring"})
        if path == "/v1/ranking":  # NIM: a logit a passage, best first
            logits = [doc_score(passage["text"]) for passage in body["passages"]]
            order = sorted(range(len(logits)), key=lambda i: -logits[i])
            return httpx.Response(200, json={"rankings": [{"index": i, "logit": logits[i]} for i in order]})
        if path in ("/v2/rerank", "/v1/rerank", "/rerank"):
            docs = body.get("documents") or body.get("texts")
            ranked = sorted(range(len(docs)), key=lambda i: -doc_score(docs[i]))
            key = "score" if "texts" in body or "return_documents" in body else "relevance_score"
            results = [{"index": i, key: doc_score(docs[i])} for i in ranked]
            return httpx.Response(200, json=results if key == "score" else {"id": "r", "results": results})
        return httpx.Response(404, json={"error": {"message": "no route", "type": "NotFoundError",
                                                   "param": None, "code": 404}})

    def posts(self) -> list[httpx.Request]:
        return [request for request in self.requests if request.method == "POST"]


@pytest.fixture(autouse=True)
def fresh_discovery():
    forget()
    yield
    forget()


def backend(server: FakeServer, url: str = "http://fake:8000", **options) -> RemoteBackend:
    return RemoteBackend(url, transport=httpx.MockTransport(server), **options)


def test_scores_come_back_in_input_order_across_split_requests():
    server = FakeServer()
    with backend(server, dialect="cohere", served_model="rerank-v3.5", max_items_per_request=3) as remote:
        response = remote.score(ScoreRequest(query="q", items=DOCS))
    assert response.scores == [doc_score(doc) for doc in DOCS]
    assert sorted(len(json.loads(r.content)["documents"]) for r in server.posts()) == [1, 3, 3, 3]
    for request in server.posts():
        REQUEST_MODELS["cohere"].model_validate(json.loads(request.content))


async def test_async_scores_split_and_reassemble():
    server = FakeServer()
    remote = backend(server, dialect="vllm-generative", max_items_per_request=4)
    response = await remote.ascore(ScoreRequest(query="q", items=DOCS, label_token_ids=[1, 2]))
    await remote.aclose()
    assert response.scores == [doc_score(doc) for doc in DOCS]
    assert response.usage.prompt_tokens == 7 * len(DOCS)
    assert sorted(len(json.loads(r.content)["items"]) for r in server.posts()) == [2, 4, 4]


def test_api_key_is_sent_as_bearer_token_and_model_on_the_wire():
    server = FakeServer()
    with backend(server, dialect="cohere", api_key="sekret", served_model="rerank-v3.5") as remote:
        remote.score(ScoreRequest(query="q", items=DOCS[:2]))
    sent = server.posts()[0]
    assert sent.headers["authorization"] == "Bearer sekret"
    assert sent.url.path == "/v2/rerank" and json.loads(sent.content)["model"] == "rerank-v3.5"


def test_cohere_without_served_model_sends_the_one_from_v1_models_once():
    server = FakeServer(models=[{"id": "served-reranker", "owned_by": "rerankit"}])
    with backend(server, "http://models-probe:8000", dialect="cohere") as remote:
        remote.score(ScoreRequest(query="q", items=DOCS[:2]))
        remote.score(ScoreRequest(query="q", items=DOCS[:2]))
    assert [r.url.path for r in server.requests if r.method == "GET"] == ["/v1/models"]
    assert [json.loads(sent.content)["model"] for sent in server.posts()] == ["served-reranker"] * 2


def test_path_option_posts_to_another_route_of_the_dialect():
    server = FakeServer()
    with backend(server, dialect="cohere", path="/v1/rerank") as remote:
        remote.score(ScoreRequest(query="q", items=DOCS[:2]))
    assert server.posts()[0].url.path == "/v1/rerank"


def test_refused_field_raises_before_any_request():
    server = FakeServer()
    with backend(server, dialect="tei") as remote:
        with pytest.raises(InvalidRequest, match="label_token_ids"):
            remote.score(ScoreRequest(query="q", items=DOCS, label_token_ids=[1]))
    assert server.requests == []


def test_vllm_openapi_picks_generative_for_label_ids_and_score_otherwise():
    server = FakeServer(openapi_paths=["/generative_scoring", "/score", "/rerank", "/v1/models", "/health"],
                        models=[{"id": "Qwen/Qwen3-Reranker-0.6B", "object": "model", "owned_by": "vllm"}])
    with backend(server) as remote:
        remote.score(ScoreRequest(query="q", items=DOCS[:2], label_token_ids=[1, 2]))
        remote.score(ScoreRequest(query="q", items=DOCS[:2]))
        assert remote.model_name == "Qwen/Qwen3-Reranker-0.6B"
    assert [r.url.path for r in server.posts()] == ["/generative_scoring", "/score"]
    assert json.loads(server.posts()[0].content)["model"] == "Qwen/Qwen3-Reranker-0.6B"


@pytest.mark.parametrize(("paths", "models", "info", "label_ids", "route"), [
    (["/v1/score", "/v1/rerank", "/get_model_info", "/flush_cache"], None, None, None, "/v1/rerank"),
    (["/v1/score", "/v1/rerank", "/get_model_info", "/flush_cache"], None, None, [1, 2], "/v1/score"),
    (["/rerank", "/embed", "/info", "/predict"], None, None, None, "/rerank"),
    (["/v2/rerank", "/health"], None, None, None, "/v2/rerank"),
    ([], [{"id": "m", "owned_by": "sglang"}], None, None, "/v1/rerank"),
    ([], [{"id": "m", "owned_by": "vllm"}], None, [1], "/generative_scoring"),
    ([], None, {"model_id": "BAAI/bge-reranker-base", "model_type": {"reranker": {}}}, None, "/rerank"),
])
def test_discovery_reads_what_the_server_publishes(paths, models, info, label_ids, route):
    server = FakeServer(openapi_paths=paths, models=models, info=info)
    with backend(server) as remote:
        response = remote.score(ScoreRequest(query="q", items=DOCS[:2], label_token_ids=label_ids))
    assert server.posts()[0].url.path == route
    assert response.scores == [doc_score(doc) for doc in DOCS[:2]]


def test_discovery_finds_a_nim_by_its_published_ranking_path():
    """NVIDIA NIM's /v1/models names no owner (its docs' example: ``{"id": "nvidia/llama-3.2-nv-rerankqa-1b-v2"}``):
    /v1/ranking among the paths of its /openapi.json tells it apart; its logits come back through the sigmoid."""
    server = FakeServer(openapi_paths=["/v1/ranking", "/v1/models", "/v1/health/ready", "/v1/health/live"],
                        models=[{"id": "nvidia/llama-3.2-nv-rerankqa-1b-v2"}])
    with backend(server) as remote:
        response = remote.score(ScoreRequest(query="q", items=DOCS[:2]))
        assert remote.model_name == "nvidia/llama-3.2-nv-rerankqa-1b-v2"
    assert [r.url.path for r in server.posts()] == ["/v1/ranking"]
    assert json.loads(server.posts()[0].content)["model"] == "nvidia/llama-3.2-nv-rerankqa-1b-v2"
    assert response.scores == pytest.approx([1 / (1 + math.exp(-doc_score(doc))) for doc in DOCS[:2]])


def test_discovery_is_cached_per_base_url():
    server = FakeServer(openapi_paths=["/v2/rerank"])
    for _ in range(2):
        with backend(server) as remote:
            remote.score(ScoreRequest(query="q", items=DOCS[:2]))
    assert [r.url.path for r in server.requests if r.method == "GET"] == ["/openapi.json", "/v1/models"]


def test_a_model_hidden_from_a_wrong_key_is_read_again_with_the_right_one():
    """/v1/models refused a wrong key (401): that says nothing about the model, so it is not cached as "none"."""
    def cohere(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer right":
            return httpx.Response(401, json={"message": "invalid api token"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "rerank-v3.5"}]})
        body = json.loads(request.content)
        if "model" not in body:
            return httpx.Response(400, json={"message": "model is required"})
        return httpx.Response(200, json={"results": [{"index": i, "relevance_score": 0.5}
                                                     for i in range(len(body["documents"]))]})

    def keyed(key: str) -> RemoteBackend:
        return RemoteBackend("http://keyed:8000", dialect="cohere", api_key=key, transport=httpx.MockTransport(cohere))

    with keyed("wrong") as remote, pytest.raises(RemoteError) as refused:
        remote.score(ScoreRequest(query="q", items=DOCS[:2]))
    assert refused.value.status_code == 401
    with keyed("right") as remote:
        assert remote.score(ScoreRequest(query="q", items=DOCS[:2])).scores == [0.5, 0.5]


def test_unknown_server_asks_for_a_dialect():
    with backend(FakeServer()) as remote:
        with pytest.raises(RemoteError, match="pass dialect="):
            remote.score(ScoreRequest(query="q", items=DOCS[:2]))


@pytest.mark.parametrize("status", [503, 500, 404, 401])
def test_discovery_goes_on_to_the_next_url_when_one_answers_nothing_useful(status):
    good = FakeServer(openapi_paths=["/v2/rerank"])
    refused = []

    def route(request: httpx.Request) -> httpx.Response:
        if request.url.host == "bad":
            refused.append(request.url.path)
            return httpx.Response(status, json={"error": {"message": "loading"}})
        return good(request)

    remote = RemoteBackend(["http://bad:8000", "http://good:8000"], transport=httpx.MockTransport(route))
    with remote:
        response = remote.score(ScoreRequest(query="q", items=DOCS[:2]))
    assert response.scores == [doc_score(doc) for doc in DOCS[:2]]
    assert refused[:1] == ["/openapi.json"] and [r.url.path for r in good.posts()] == ["/v2/rerank"]


@pytest.mark.parametrize(("status", "advice"), [(401, "check api_key"), (503, "still starting"),
                                                (404, "pass dialect=")])
def test_every_probe_refused_with_one_status_names_it(status, advice):
    """A starting server's 503 is asked again (max_retries=3: 4 rounds of probes), a 401 or 404 is not."""
    asked = []

    def refuse(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(status, json={"error": {"message": "no"}})

    transport = httpx.MockTransport(refuse)
    with RemoteBackend(["http://a:8000", "http://b:8000"], transport=transport, backoff_base=0) as remote:
        with pytest.raises(RemoteError) as error:
            remote.score(ScoreRequest(query="q", items=DOCS[:2]))
    assert str(error.value).startswith(f"HTTP {status} from http://a:8000, http://b:8000: every discovery probe "
                                       "(/openapi.json, /v1/models, /info) got ")
    assert advice in str(error.value) and error.value.status_code == status
    assert len(asked) == 2 * 3 * (4 if status == 503 else 1)


def test_no_discovered_route_accepting_the_request_gives_the_first_refusal():
    server = FakeServer(openapi_paths=["/v2/rerank"])
    with backend(server) as remote:
        with pytest.raises(InvalidRequest) as refused:
            remote.score(ScoreRequest(query="q", items=DOCS[:2], label_token_ids=[1, 2]))
    assert refused.value.field == "label_token_ids"


@pytest.mark.parametrize(("status", "body", "expected"), [
    (400, {"error": {"message": "label_token_id 9 is out of vocabulary range [0, 8)", "type": "BadRequestError",
                     "param": None, "code": 400}}, "out of vocabulary range"),
    (400, {"object": "error", "message": "must not be empty", "type": "BadRequestError", "param": "items",
           "code": 400}, "items: must not be empty"),
    (422, {"error": "batch size 64 > maximum allowed batch size 32", "error_type": "Validation"}, "batch size 64"),
    (401, {"message": "invalid api token"}, "invalid api token"),
    (404, "plain text, not JSON", "plain text"),
])
def test_server_error_bodies_surface_in_remote_error(status, body, expected):
    def handler(request):
        return httpx.Response(status, json=body) if isinstance(body, dict) else httpx.Response(status, text=body)

    remote = RemoteBackend("http://fake:8000", dialect="vllm-score", transport=httpx.MockTransport(handler))
    with pytest.raises(RemoteError) as failed:
        remote.score(ScoreRequest(query="q", items=DOCS[:2]))
    remote.close()
    assert failed.value.status_code == status
    assert expected in str(failed.value) and "http://fake:8000/score" in str(failed.value)


def test_success_that_is_not_json_is_a_remote_error():
    remote = RemoteBackend("http://fake:8000", dialect="tei",
                           transport=httpx.MockTransport(lambda request: httpx.Response(200, text="<html>")))
    with pytest.raises(RemoteError, match="not JSON"):
        remote.score(ScoreRequest(query="q", items=DOCS[:2]))
    remote.close()


def test_reranker_points_at_a_url():
    server = FakeServer()
    with Reranker("http://fake:8000", dialect="cohere", transport=httpx.MockTransport(server)) as reranker:
        ranked = reranker.rank("q", DOCS[:4], top_n=2)
    assert [document.text for document in ranked] == [DOCS[3], DOCS[2]]


@pytest.mark.parametrize(("options", "field"), [
    ({"dialect": "grpc"}, "dialect"),
    ({"path": "/v1/rerank"}, "path"),
    ({"max_items_per_request": 0}, "max_items_per_request"),
    ({"max_concurrency": 0}, "max_concurrency"),
    ({"max_retries": -1}, "max_retries"),
])
def test_bad_options_are_refused(options, field):
    with pytest.raises(InvalidRequest) as refused:
        RemoteBackend("http://fake:8000", **options)
    assert refused.value.field == field


def test_urls_must_be_http():
    with pytest.raises(InvalidRequest, match="not an http"):
        RemoteBackend(["http://a:1", "ftp://b"])


async def test_async_context_of_reranker_closes_the_async_pool():
    server = FakeServer()
    async with Reranker("http://fake:8000", dialect="cohere", transport=httpx.MockTransport(server)) as reranker:
        ranked = await reranker.arank("q", DOCS[:3])
        pool = reranker.backend.transport._loop_clients[asyncio.get_running_loop()].client
    assert [document.index for document in ranked] == [2, 1, 0]
    assert pool.is_closed


def test_one_backend_serves_successive_event_loops():
    remote = backend(FakeServer(), dialect="cohere")
    for _ in range(2):
        assert asyncio.run(remote.ascore(ScoreRequest(query="q", items=DOCS[:2]))).scores == [0.0, 0.01]
    remote.close()


def test_a_split_call_that_fails_sends_nothing_more():
    retrying = threading.Event()
    hits = {0: 0, 1: 0}

    def server(request: httpx.Request) -> httpx.Response:
        part = json.loads(request.content)["part"]
        hits[part] += 1
        if part == 1:  # retryable: the client backs off and would try again
            retrying.set()
            return httpx.Response(503, json={"error": "busy"})
        retrying.wait(5)  # part 1 is waiting to retry when part 0 fails for good
        return httpx.Response(400, json={"error": "bad"})

    config = ClientConfig(max_retries=5, backoff_base=1.0, backoff_max=1.0, deadline=30.0)
    transport = Transport(["http://fake:8000"], config, transport=httpx.MockTransport(server))
    with pytest.raises(RemoteError) as failed:
        transport.post_all("/score", [{"part": 0}, {"part": 1}])
    assert failed.value.status_code == 400
    transport._executor.shutdown(wait=True)  # the posts still running end (at once: they are told to stop)
    assert hits == {0: 1, 1: 1}
    transport.close()


def test_an_undecodable_reply_is_a_remote_error():
    def server(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"not gzip at all", headers={"content-encoding": "gzip"})

    with pytest.raises(RemoteError, match="DecodingError"):
        with backend(server, dialect="vllm-score", max_retries=0) as remote:
            remote.score(ScoreRequest(query="q", items=DOCS[:2]))
