"""Bad input of any shape is a 4xx with a JSON body in the error format of the route's dialect, never a 5xx,
and the server keeps serving. A table of known cases, then bounded random junk.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest
from wire_models import ERROR_MODELS

from rerankit.server.routes import ROUTES

GOOD_GENERATIVE = {"query": "q", "items": ["a", "b"], "label_token_ids": [5, 6]}


CASES = [
    # server, path, body (dict: JSON; bytes: raw), status, dialect of the error body, what the error must name
    ("lm", "/generative_scoring", b"{not json", 400, "vllm-rerank", "JSON"),
    ("lm", "/generative_scoring", b"\xff\xfe\x00garbage", 400, "vllm-rerank", "UTF-8"),
    ("lm", "/generative_scoring", b'{"query": "\\ud800", "items": ["a"], "label_token_ids": [1]}', 400, "vllm-rerank",
     "surrogate"),
    ("lm", "/generative_scoring", b"[" * 5000 + b"]" * 5000, 400, "vllm-rerank", "body"),
    ("lm", "/generative_scoring", b'{"query": "q", "items": ["a"], "label_token_ids": [NaN]}', 400, "vllm-rerank",
     "NaN"),
    ("lm", "/generative_scoring", b'{"query": "q", "items": ["a"], "label_token_ids": [1e400]}', 400, "vllm-rerank",
     "label_token_ids"),
    ("lm", "/generative_scoring", b'{"query": "q", "items": ["a"], "label_token_ids": [' + b"9" * 5000 + b"]}", 400,
     "vllm-rerank", "JSON"),
    ("lm", "/generative_scoring", b"", 400, "vllm-rerank", "JSON"),
    ("lm", "/generative_scoring", b"null", 400, "vllm-rerank", "object"),
    ("lm", "/generative_scoring", [1, 2, 3], 400, "vllm-rerank", "object"),
    ("lm", "/generative_scoring", {**GOOD_GENERATIVE, "query": 5}, 400, "vllm-rerank", "query"),
    ("lm", "/generative_scoring", {**GOOD_GENERATIVE, "items": []}, 400, "vllm-rerank", "items"),
    ("lm", "/generative_scoring", {**GOOD_GENERATIVE, "items": "abc"}, 400, "vllm-rerank", "items"),
    ("lm", "/generative_scoring", {**GOOD_GENERATIVE, "items": [["a"], [1]]}, 400, "vllm-rerank", "items"),
    ("lm", "/generative_scoring", {**GOOD_GENERATIVE, "label_token_ids": []}, 400, "vllm-rerank", "label_token_ids"),
    ("lm", "/generative_scoring", {**GOOD_GENERATIVE, "label_token_ids": [10**9]}, 400, "vllm-rerank", "vocabulary"),
    ("lm", "/generative_scoring", {**GOOD_GENERATIVE, "label_token_ids": [-1]}, 400, "vllm-rerank", "label"),
    ("lm", "/generative_scoring", {**GOOD_GENERATIVE, "query": [1, 2**70]}, 400, "vllm-rerank", "vocabulary"),
    ("lm", "/generative_scoring", {**GOOD_GENERATIVE, "items": [[3], [2**63 + 5]]}, 400, "vllm-rerank", "vocabulary"),
    ("lm", "/generative_scoring", {**GOOD_GENERATIVE, "label_token_ids": list(range(129))}, 400, "vllm-rerank", "128"),
    ("lm", "/v1/score", {**GOOD_GENERATIVE, "temperature": 0}, 400, "sglang-score", "temperature"),
    ("lm", "/v1/score", {**GOOD_GENERATIVE, "label_token_ids": [[5], [6]]}, 400, "sglang-score", "label_token_ids"),
    ("lm", "/v1/score", {**GOOD_GENERATIVE, "label_token_ids": [10**6]}, 400, "sglang-score", "vocabulary"),
    ("ce", "/score", {"text_1": "q"}, 400, "vllm-rerank", "queries"),
    ("ce", "/score", {"queries": ["q1", "q2"], "documents": ["a"]}, 400, "vllm-rerank", "queries"),
    ("ce", "/rerank", {"query": "q", "documents": [1, 2]}, 400, "vllm-rerank", "documents"),
    ("ce", "/rerank", {"query": "q", "documents": ["d"] * 17}, 413, "vllm-rerank", "max_items_per_request"),
    ("ce", "/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, 400, "vllm-rerank", "top_n"),
    ("ce", "/rerank", {"query": "", "documents": ["d"]}, 400, "vllm-rerank", "query"),
    ("ce", "/rerank", {"query": "q", "texts": ["word " * 300], "truncate": False}, 400, "tei", "64"),
    ("ce", "/v1/rerank", {"query": "q", "documents": ["d"], "top_n": 0, "return_documents": False}, 400,
     "sglang-score", "top_n"),
    ("ce", "/v2/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, 400, "cohere", "top_n"),
    ("ce", "/v2/rerank", {"query": {"text": "q"}, "documents": ["d"]}, 400, "cohere", "query"),
    ("ce", "/v2/rerank", {"query": "q", "documents": ["d", "e"], "top_n": True}, 400, "cohere", "top_n"),
    ("ce", "/rerank", {"query": "q", "documents": ["d", "e"], "top_n": True}, 400, "vllm-rerank", "top_n"),
    ("lm", "/generative_scoring", {**GOOD_GENERATIVE, "label_token_ids": [True, 6]}, 400, "vllm-rerank",
     "label_token_ids"),
    ("ce", "/generative_scoring", GOOD_GENERATIVE, 400, "vllm-rerank", "mode"),
]


@pytest.fixture
def urls(lm_url, ce_url):
    return {"lm": lm_url, "ce": ce_url}


@pytest.mark.parametrize("server, path, body, status, dialect, names", CASES,
                         ids=[f"{case[1]}-{number}" for number, case in enumerate(CASES)])
def test_bad_input_is_a_4xx_in_the_dialects_error_format(urls, server, path, body, status, dialect, names):
    payload = {"content": body} if isinstance(body, bytes) else {"json": body}
    reply = httpx.post(urls[server] + path, headers={"content-type": "application/json"}, timeout=30, **payload)
    assert reply.status_code == status, reply.text
    error = reply.json()
    ERROR_MODELS[dialect].model_validate(error)
    if dialect.startswith("vllm"):
        assert error["error"]["code"] == status
    elif dialect.startswith("sglang"):
        assert error["code"] == status
    assert names.lower() in json.dumps(error).lower(), error


def junk_value(rng: random.Random, depth: int = 0):
    """A random JSON value, biased to the shapes that break parsers: big numbers, odd text, nesting."""
    kinds = ["int", "bigint", "float", "text", "bool", "null"] + (["list", "object"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(-5, 2000)
    if kind == "bigint":
        return rng.choice([2**31, 2**63, 2**64 + 1, -(2**70), 10**200])
    if kind == "float":
        return rng.choice([0.0, -1.5, 1e308, 3.7, 1e-320])
    if kind == "text":
        return rng.choice(["", " ", "q", "\u0000", "é" * 50, "\U0001f600", "<|im_end|>", "x" * 2000])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [junk_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(FIELDS): junk_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


FIELDS = ["query", "items", "documents", "texts", "queries", "text_1", "text_2", "data_1", "data_2",
          "label_token_ids", "apply_softmax", "top_n", "item_first", "return_documents", "truncate",
          "max_tokens_per_doc", "instruct", "temperature", "model", "raw_scores", "return_pooled_hidden_states"]


def junk_body(rng: random.Random) -> bytes:
    """Random bytes, a broken JSON text, or a JSON object of the routes' field names with random values."""
    roll = rng.random()
    if roll < 0.15:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    if roll < 0.25:
        text = json.dumps({"query": "q", "items": ["a"]})
        return text[: rng.randint(0, len(text))].encode()
    body = {field: junk_value(rng) for field in rng.sample(FIELDS, rng.randint(1, 6))}
    return json.dumps(body).encode()


def test_random_junk_bodies_never_get_a_5xx(urls):
    rng = random.Random(20261123)
    paths = list(ROUTES)
    with httpx.Client(timeout=30) as client:
        for _ in range(800):
            url = urls[rng.choice(["lm", "ce"])] + rng.choice(paths)
            body = junk_body(rng)
            reply = client.post(url, content=body, headers={"content-type": "application/json"})
            assert reply.status_code < 500, (url, body[:200], reply.text)
            reply.json()  # always a JSON body
        assert client.post(urls["lm"] + "/generative_scoring", json=GOOD_GENERATIVE).status_code == 200


WIRE_NAMED = [
    # path, body, status, the body's name of the field the engine refused
    ("/rerank", {"query": "q", "texts": ["a", "word " * 300], "truncate": False}, 400, "texts[1]"),
    ("/rerank", {"query": "q", "documents": ["a", "word " * 300]}, 400, "documents[1]"),  # vLLM's: cut only if asked
    ("/rerank", {"query": "q", "documents": ["d"] * 17}, 413, "documents"),
    ("/v2/rerank", {"model": "m", "query": "q", "documents": ["d"] * 17}, 413, "documents"),
    ("/generative_scoring", GOOD_GENERATIVE, 400, "label_token_ids"),
]


@pytest.mark.parametrize("path, body, status, field", WIRE_NAMED, ids=[case[3] for case in WIRE_NAMED])
def test_an_error_found_after_parsing_names_the_field_as_the_body_does(ce_url, path, body, status, field):
    reply = httpx.post(ce_url + path, json=body, timeout=30)
    assert reply.status_code == status, reply.text
    text = json.dumps(reply.json())
    assert f"{field}:" in text and "items:" not in text and "items[" not in text and "mode:" not in text, text
