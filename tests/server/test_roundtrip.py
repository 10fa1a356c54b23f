"""``rerankit serve`` with the real engine on loopback: every dialect round-trips through ``RemoteBackend``
to the scores of the embedded backend; top_n and order on the wire; token limits; batching; idle latency.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
from live_server import live_server
from wire_models import RESPONSE_MODELS, SORTED_RESPONSES

from rerankit.remote import DIALECTS, RemoteBackend
from rerankit.schema import ScoreRequest
from rerankit.server.app import create_app
from rerankit.server.limits import ServerConfig

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital and most populous city of France.", "The quick brown fox jumps over the lazy dog.",
        "Gravity is a force that attracts two bodies towards each other.", "The capital of China is Beijing.",
        "yes no Yes No"]
TOLERANCE = 1e-5


def assert_same_scores(remote, local, *, tokens: bool) -> None:
    assert [r.index for r in remote.results] == list(range(len(local.results)))
    for got, want in zip(remote.scores, local.scores):
        assert got == pytest.approx(want, abs=TOLERANCE)
    if tokens:
        assert remote.usage.prompt_tokens == local.usage.prompt_tokens > 0


@pytest.mark.parametrize("dialect", ["vllm-generative", "sglang-score"])
@pytest.mark.parametrize("apply_softmax", [True, False])
def test_generative_dialects_round_trip_to_embedded_scores(lm, lm_url, label_ids, dialect, apply_softmax):
    request = ScoreRequest(query=QUERY, items=DOCS, label_token_ids=label_ids, apply_softmax=apply_softmax)
    local = lm.score(request.model_copy(update={"template": "raw", "mode": "generative"}))
    with RemoteBackend(lm_url, dialect=dialect) as remote:
        assert_same_scores(remote.score(request), local, tokens=True)


def test_generative_token_ids_round_trip(lm, lm_url, label_ids):
    request = ScoreRequest(query=[11, 12, 13], items=[[20, 21], [22], [23, 24, 25]], label_token_ids=label_ids)
    local = lm.score(request.model_copy(update={"template": "raw", "mode": "generative"}))
    with RemoteBackend(lm_url, dialect="vllm-generative") as remote:
        assert_same_scores(remote.score(request), local, tokens=True)


def test_sglang_label_logprobs_round_trip(lm, lm_url, label_ids):
    request = ScoreRequest(query=QUERY, items=DOCS, label_token_ids=label_ids, return_label_logprobs=True)
    local = lm.score(request.model_copy(update={"template": "raw", "mode": "generative"}))
    with RemoteBackend(lm_url, dialect="sglang-score") as remote:
        response = remote.score(request)
    for got, want in zip(response.results, local.results):
        assert got.label_logprobs == pytest.approx(want.label_logprobs, abs=TOLERANCE)


# Dialects whose wire carries token counts (TEI and SGLang's /v1/rerank carry none).
@pytest.mark.parametrize("dialect, tokens", [("vllm-score", True), ("vllm-rerank", True), ("sglang-score", True),
                                             ("sglang-rerank", False), ("cohere", True), ("jina", True),
                                             ("tei", False),
                                             ("nim", False), ("voyage", True)])
async def test_cross_encoder_dialects_round_trip_to_embedded_scores(ce, ce_url, dialect, tokens):
    request = ScoreRequest(query=QUERY, items=DOCS)
    local = ce.score(request)
    with RemoteBackend(ce_url, dialect=dialect) as remote:
        assert_same_scores(remote.score(request), local, tokens=tokens)
    async with RemoteBackend(ce_url, dialect=dialect) as remote:
        assert_same_scores(await remote.ascore(request), local, tokens=tokens)


def test_discovery_finds_the_servers_routes(ce, ce_url):
    request = ScoreRequest(query=QUERY, items=DOCS)
    with RemoteBackend(ce_url) as remote:
        assert_same_scores(remote.score(request), ce.score(request), tokens=True)
        assert remote.model_name == "tiny-ce"


# Every (dialect, path) the dialect lists, but Cohere's at /v1/rerank: a body of query, documents and model there
# is answered in vLLM's Jina-compatible form (see rerankit.server.routes).
WIRE_PATHS = [(name, path) for name, dialect in DIALECTS.items() for path in dialect.paths
              if (name, path) != ("cohere", "/v1/rerank")]


@pytest.mark.parametrize("name, path", WIRE_PATHS)
def test_response_bodies_match_the_peers_wire_models(lm_url, ce_url, label_ids, name, path):
    generative = name in ("vllm-generative", "sglang-score")
    request = ScoreRequest(query=QUERY, items=DOCS, label_token_ids=label_ids if generative else None)
    _, body = DIALECTS[name].encode_request(request, "tiny")
    reply = httpx.post((lm_url if generative else ce_url) + path, json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    payload = reply.json()
    RESPONSE_MODELS[name].model_validate(payload)
    scores = [score for _, score in wire_results(payload)]
    assert len(scores) == len(DOCS)
    if name in SORTED_RESPONSES:
        assert scores == sorted(scores, reverse=True)


def wire_results(payload) -> list[tuple[int, float]]:
    """(index, score) of each result of any dialect's response body, in the body's order."""
    if isinstance(payload, list):
        return [(entry["index"], entry["score"]) for entry in payload]
    if "scores" in payload:
        return [(index, values[0]) for index, values in enumerate(payload["scores"])]
    if "data" in payload:
        return [(entry["index"], entry.get("score", entry.get("relevance_score"))) for entry in payload["data"]]
    if "rankings" in payload:
        return [(entry["index"], entry["logit"]) for entry in payload["rankings"]]
    return [(entry["index"], entry["relevance_score"]) for entry in payload["results"]]


@pytest.mark.parametrize("name, path, options", [
    ("vllm-rerank", "/rerank", {}), ("vllm-rerank", "/v1/rerank", {}),
    ("sglang-rerank", "/v1/rerank", {"return_documents": True}),
    ("cohere", "/v2/rerank", {"model": "tiny-ce"}), ("jina", "/v1/rerank", {"model": "m", "return_documents": True}),
    ("cohere", "/v1/rerank", {"model": "m", "return_documents": True, "rank_fields": ["text"]}),
])
def test_rerank_routes_return_the_top_n_best_first(ce, ce_url, name, path, options):
    best = ce.score(ScoreRequest(query=QUERY, items=DOCS)).ranked(2)
    reply = httpx.post(ce_url + path, json={"query": QUERY, "documents": DOCS, "top_n": 2, **options}, timeout=30)
    assert reply.status_code == 200, reply.text
    RESPONSE_MODELS[name].model_validate(reply.json())
    pairs = wire_results(reply.json())
    assert [index for index, _ in pairs] == [result.index for result in best]
    assert [score for _, score in pairs] == pytest.approx([result.score for result in best], abs=TOLERANCE)


def test_items_over_the_token_limit_are_cut_or_refused_as_the_request_says(ce, ce_url):
    long_doc = " ".join(["gravity"] * 200)
    cut = httpx.post(ce_url + "/rerank", json={"query": QUERY, "texts": [long_doc], "truncate": True}, timeout=30)
    assert cut.status_code == 200, cut.text
    local = ce.score(ScoreRequest(query=QUERY, items=[long_doc], max_tokens_per_item=64))
    assert cut.json()[0]["score"] == pytest.approx(local.scores[0], abs=TOLERANCE)
    refused = httpx.post(ce_url + "/rerank", json={"query": QUERY, "texts": [long_doc], "truncate": False}, timeout=30)
    assert refused.status_code == 400
    assert "64" in refused.json()["error"] and refused.json()["error_type"] == "Validation"


async def test_concurrent_requests_share_batches(lm_url, label_ids):
    def batches(page: str) -> tuple[int, int]:
        count = re.search(r"^rerankit_batches_total (\d+)", page, re.M)
        merged = re.search(r"^rerankit_batch_requests_sum (\S+)", page, re.M)
        return int(count.group(1)), int(float(merged.group(1)))

    body = {"query": QUERY, "items": DOCS, "label_token_ids": label_ids}
    async with httpx.AsyncClient(base_url=lm_url, timeout=30) as client:
        before = batches((await client.get("/metrics")).text)
        replies = await asyncio.gather(*(client.post("/generative_scoring", json=body) for _ in range(12)))
        after = batches((await client.get("/metrics")).text)
    assert all(reply.status_code == 200 for reply in replies)
    calls, requests = after[0] - before[0], after[1] - before[1]
    assert requests == 12
    assert calls < 12, f"12 concurrent requests went in {calls} batches: none were merged"


class EngineCallCounter:
    """Delegates to the real engine, recording how many requests each engine call held."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.calls: list[int] = []
        self.model_name = backend.model_name

    def score(self, request):
        self.calls.append(1)
        return self.backend.score(request)

    def score_batch(self, requests, **options):
        self.calls.append(len(requests))
        return self.backend.score_batch(requests, **options)


async def test_concurrent_requests_are_scored_in_one_engine_call_with_unchanged_scores(lm, label_ids):
    if not hasattr(lm, "score_batch"):
        pytest.skip("EmbeddedBackend has no score_batch yet: the server scores a batch's requests one by one")
    counter = EngineCallCounter(lm)
    queries = [f"{QUERY} {number}" for number in range(8)]
    with live_server(create_app(counter, ServerConfig())) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            replies = await asyncio.gather(*(client.post("/generative_scoring", json={
                "query": query, "items": DOCS, "label_token_ids": label_ids}) for query in queries))
    assert max(counter.calls) > 1, f"engine calls held {counter.calls} requests: none merged"
    for query, reply in zip(queries, replies):
        local = lm.score(ScoreRequest(query=query, items=DOCS, label_token_ids=label_ids, template="raw",
                                      mode="generative"))
        assert [entry["score"] for entry in reply.json()["data"]] == pytest.approx(local.scores, abs=TOLERANCE)


def test_lone_request_on_an_idle_server_is_not_held_for_the_window(lm_url, label_ids):
    """Asserts the mechanism, not a time: the engine call that answered it was not held back for company
    (``rerankit_batches_held_total`` counts calls that waited the window)."""
    body = {"query": QUERY, "items": DOCS[:2], "label_token_ids": label_ids}

    def counters(client: httpx.Client) -> tuple[int, int]:
        page = client.get("/metrics").text
        return tuple(int(float(re.search(rf"^{name} (\S+)$", page, re.M).group(1)))
                     for name in ("rerankit_batches_total", "rerankit_batches_held_total"))

    with httpx.Client(base_url=lm_url, timeout=30) as client:
        client.post("/generative_scoring", json=body)
        time.sleep(0.3)  # let the engine go cold (the window is 0.2 s)
        calls, held = counters(client)
        reply = client.post("/generative_scoring", json=body)
        assert reply.status_code == 200
        assert counters(client) == (calls + 1, held), "the lone request's engine call was held for the window"
