"""Raw scores over the wire: TEI's and Infinity's ``raw_scores`` and vLLM's ``use_activation: false`` answered with
the engine's logits, and the remote client asking a server for them in each of those dialects."""

from __future__ import annotations

import httpx
import pytest
from live_server import live_server

from rerankit.remote import RemoteBackend
from rerankit.schema import ScoreRequest
from rerankit.server.app import create_app

QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the dog sat on the mat", "berlin is in germany"]


@pytest.fixture(scope="module")
def served(ce):
    with live_server(create_app(ce)) as url:
        yield url


@pytest.fixture(scope="module")
def logits(ce) -> list[float]:
    return ce.score(ScoreRequest(query=QUERY, items=DOCS, raw_scores=True)).scores


def by_index(rows: list[dict], field: str) -> list[float]:
    return [row[field] for row in sorted(rows, key=lambda row: row["index"])]


def test_tei_raw_scores(served, logits):
    reply = httpx.post(f"{served}/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True}, timeout=10)
    assert reply.status_code == 200, reply.text
    assert by_index(reply.json(), "score") == pytest.approx(logits, abs=1e-6)


def test_infinity_raw_scores(served, logits):
    body = {"query": QUERY, "documents": DOCS, "raw_scores": True, "return_documents": False, "model": "m"}
    reply = httpx.post(f"{served}/rerank", json=body, timeout=10)
    assert reply.status_code == 200, reply.text
    assert by_index(reply.json()["results"], "relevance_score") == pytest.approx(logits, abs=1e-6)


@pytest.mark.parametrize("flag", ["use_activation", "softmax", "activation"])
def test_vllm_use_activation_false(served, logits, flag):
    reply = httpx.post(f"{served}/v1/score", json={"text_1": QUERY, "text_2": DOCS, flag: False}, timeout=10)
    assert reply.status_code == 200, reply.text
    assert by_index(reply.json()["data"], "score") == pytest.approx(logits, abs=1e-6)


@pytest.mark.parametrize("dialect", ["tei", "infinity", "vllm-score", "vllm-rerank"])
def test_the_remote_client_gets_raw_scores_in_each_dialect_that_has_them(served, logits, dialect):
    with RemoteBackend(served, dialect=dialect, served_model="m") as remote:
        scores = remote.score(ScoreRequest(query=QUERY, items=DOCS, raw_scores=True)).scores
    assert scores == pytest.approx(logits, abs=1e-6)
