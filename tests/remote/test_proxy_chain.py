"""Proxy mode end to end: clients -> ``rerankit serve --model http://far`` (``create_app(RemoteBackend(far))``) ->
a far ``rerankit serve`` running the embedded engine on tiny random-weight models, all on loopback.

Every body a client of each dialect sends is posted to the far server and to a proxy of each far dialect: the
proxy answers what the far server answers (scores, order, ``top_n``, documents, model, tokens where the far dialect
carries them), and the scores are the embedded backend's. What a proxy cannot forward is refused naming the field as
the client's body calls it; what the far server refuses comes back in the client's dialect with a sensible status.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from live_server import live_server

from rerankit import Reranker
from rerankit.remote import RemoteBackend, get_dialect
from rerankit.remote.dialects import read_error
from rerankit.schema import ScoreRequest
from rerankit.server.app import create_app, public_model_name
from rerankit.server.limits import ServerConfig

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital and most populous city of France.", "The quick brown fox jumps over the lazy dog.",
        "Gravity is a force that attracts two bodies towards each other.", "The capital of China is Beijing.",
        "yes no Yes No"]
TITLED = [{"title": f"Doc {i}", "text": text} for i, text in enumerate(DOCS)]
COHERE_SDK = {"X-Fern-SDK-Name": "cohere"}
FAR_ITEM_LIMIT = 16
TOLERANCE = 1e-5
CE_DIALECTS = ["vllm-score", "vllm-rerank", "sglang-score", "sglang-rerank", "cohere", "tei", "infinity", None]
LM_DIALECTS = ["vllm-generative", "sglang-score", None]
NO_TOKEN_COUNTS = {"tei", "sglang-rerank"}  # far dialects whose replies carry no token counts


@pytest.fixture(scope="module")
def far_lm(lm):
    with live_server(create_app(lm, ServerConfig(served_model_name="tiny-lm", batch_window_ms=0))) as url:
        yield url


@pytest.fixture(scope="module")
def far_ce(ce):
    config = ServerConfig(served_model_name="tiny-ce", max_items_per_request=FAR_ITEM_LIMIT, batch_window_ms=0)
    with live_server(create_app(ce, config)) as url:
        yield url


@pytest.fixture(scope="module")
def proxy():
    """``proxy(far_url, dialect, **options)``: the URL of a proxy to ``far_url`` (one per arguments, kept for the
    module); ``options`` go to ``RemoteBackend``, but ``config`` (the proxy's ``ServerConfig``)."""
    started: dict[Any, str] = {}
    stacks: list[ExitStack] = []  # one a proxy: its server, then its backend

    def start(far_url: str, dialect: str | None, config: ServerConfig | None = None, **options: Any) -> str:
        key = (far_url, dialect, config, tuple(sorted(options.items())))
        if key not in started:
            stack = ExitStack()
            stacks.append(stack)
            backend = RemoteBackend(far_url, dialect=dialect, **options)
            stack.callback(backend.close)
            started[key] = stack.enter_context(live_server(create_app(backend, config)))
        return started[key]

    try:
        yield start
    finally:  # the ~20 proxies stop side by side: each waits about 0.1 s in uvicorn's shutdown
        with ThreadPoolExecutor(max(len(stacks), 1)) as pool:
            for stopped in [pool.submit(stack.close) for stack in stacks]:
                stopped.result()


def post(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=30)


def same_reply(far: Any, proxied: Any, tokens: bool = True) -> None:
    """Equal but for ids and times (and token counts, where the far dialect carries none); numbers to 1e-6 (a score
    may cross a float32 -> float64 conversion on one path and not the other)."""
    def clean(value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {k: clean(v, k) for k, v in value.items() if k not in ("id", "created")
                    and (tokens or k not in ("usage", "tokens"))}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    def compare(a: Any, b: Any, where: str) -> None:
        assert type(a) is type(b) or {type(a), type(b)} <= {int, float}, f"{where}: {a!r} != {b!r}"
        if isinstance(a, dict):
            assert a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
            for k in a:
                compare(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, list):
            assert len(a) == len(b), f"{where}: {len(a)} != {len(b)} entries"
            for i, (x, y) in enumerate(zip(a, b)):
                compare(x, y, f"{where}[{i}]")
        elif isinstance(a, float) or isinstance(b, float):
            assert a == pytest.approx(b, abs=1e-6), f"{where}: {a} != {b}"
        else:
            assert a == b, f"{where}: {a!r} != {b!r}"

    compare(clean(far), clean(proxied), "reply")


def scores_of(reply: Any, logits: bool = False) -> dict[int, float]:
    """Index -> score of a reply in any dialect (an SGLang classifier's logits activated)."""
    if isinstance(reply, list):
        pairs = [(entry["index"], entry["score"]) for entry in reply]
    elif "data" in reply:
        pairs = [(entry["index"], entry["score"]) for entry in reply["data"]]
    elif "results" in reply:
        pairs = [(entry["index"], entry["relevance_score"]) for entry in reply["results"]]
    else:
        pairs = [(index, values[0]) for index, values in enumerate(reply["scores"])]
    indexes = [index for index, _ in pairs]
    assert len(set(indexes)) == len(indexes), f"an item came back twice: {indexes}"
    return {index: 1 / (1 + math.exp(-score)) if logits else score for index, score in pairs}


def assert_scores(reply: Any, want: list[float], top_n: int | None = None, logits: bool = False) -> None:
    """Each item back once with its index and the embedded backend's score; ranked replies best first, cut to top_n."""
    got = scores_of(reply, logits)
    order = sorted(range(len(want)), key=lambda index: -want[index])
    assert set(got) == set(order[:top_n] if top_n else order)
    for index, score in got.items():
        assert score == pytest.approx(want[index], abs=TOLERANCE)
    if isinstance(reply, list) or "results" in reply:
        assert list(got) == sorted(got, key=lambda index: -want[index]), "not best first"


def assert_refused(reply: httpx.Response, status: int, dialect: str, field: str | None) -> tuple[str, str | None]:
    """A typed JSON error in ``dialect``'s shape naming ``field``; (message, param)."""
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    want_keys = get_dialect(dialect).error_body(status, "m", "p")
    assert (body.keys(), type(body.get("error"))) == (want_keys.keys(), type(want_keys.get("error"))), body
    message, param = read_error(body)
    assert message
    if field is not None:
        assert message.startswith(f"{field}:"), message
        assert param in (None, field), body  # Cohere's and TEI's bodies have no field of their own
    return message, param


# Cross-encoder bodies: (id, path, headers, body, client dialect, embedded request options, top_n, logits).
CE_CASES = [
    ("vllm-score", "/score", {}, {"queries": QUERY, "documents": DOCS}, "vllm-score", {}, None, False),
    ("vllm-score-cut", "/score", {}, {"queries": QUERY, "documents": DOCS, "truncate_prompt_tokens": -1},
     "vllm-score", {}, None, False),
    ("vllm-score-v1", "/v1/score", {}, {"text_1": QUERY, "text_2": DOCS}, "vllm-score", {}, None, False),
    ("sglang-score-softmax", "/v1/score", {}, {"query": QUERY, "items": DOCS, "apply_softmax": True},
     "sglang-score", {}, None, False),
    ("sglang-score-logits", "/v1/score", {}, {"query": QUERY, "items": DOCS}, "sglang-score", {}, None, True),
    ("vllm-rerank", "/rerank", {}, {"query": QUERY, "documents": DOCS, "top_n": 2}, "vllm-rerank", {}, 2, False),
    ("tei", "/rerank", {}, {"query": QUERY, "texts": DOCS, "return_text": True}, "tei", {}, None, False),
    ("infinity", "/rerank", {}, {"model": "m", "query": QUERY, "documents": DOCS, "raw_scores": False,
                                 "return_documents": True, "top_n": 2}, "infinity", {}, 2, False),
    ("vllm-rerank-v1", "/v1/rerank", {}, {"query": QUERY, "documents": DOCS, "top_n": 2}, "vllm-rerank", {}, 2,
     False),
    ("sglang-rerank", "/v1/rerank", {}, {"query": QUERY, "documents": DOCS, "return_documents": False, "top_n": 3},
     "sglang-rerank", {}, 3, False),
    ("jina", "/v1/rerank", {}, {"model": "m", "query": QUERY, "documents": DOCS, "top_n": 2,
                                "return_documents": True}, "jina", {}, 2, False),
    ("cohere-v1-fields", "/v1/rerank", COHERE_SDK, {"model": "m", "query": QUERY, "documents": TITLED,
                                                    "rank_fields": ["title", "text"], "return_documents": True},
     "cohere", {"items": [f"title: Doc {i}\ntext: {text}" for i, text in enumerate(DOCS)]}, None, False),
    ("cohere-v2", "/v2/rerank", {}, {"model": "m", "query": QUERY, "documents": DOCS, "top_n": 2}, "cohere", {}, 2,
     False),
    ("cohere-v2-cut", "/v2/rerank", {}, {"model": "m", "query": QUERY, "documents": DOCS, "max_tokens_per_doc": 8},
     "cohere", {"max_tokens_per_item": 8}, None, False),
    ("vllm-rerank-v2", "/v2/rerank", {}, {"query": QUERY, "documents": DOCS, "truncate_prompt_tokens": -1},
     "vllm-rerank", {}, None, False),
    ("cohere-v1-chunks", "/v1/rerank", COHERE_SDK, {"model": "m", "query": QUERY, "documents": DOCS,
                                                    "max_chunks_per_doc": 2}, "cohere", {}, None, False),
]
# What a proxy of a far dialect cannot forward: (far dialect, case) -> the field named (the client's name for it).
CE_REFUSED = {(dialect, "cohere-v2-cut"): "max_tokens_per_doc" for dialect in ("sglang-score", "sglang-rerank",
                                                                                "tei", "infinity")}
CE_REFUSED.update({(dialect, "cohere-v1-chunks"): "max_chunks_per_doc" for dialect in CE_DIALECTS})


@pytest.mark.parametrize("dialect", CE_DIALECTS, ids=str)
@pytest.mark.parametrize("case", CE_CASES, ids=[case[0] for case in CE_CASES])
def test_cross_encoder_bodies_through_the_proxy_answer_as_the_far_server(ce, far_ce, proxy, dialect, case):
    name, path, headers, body, client, options, top_n, logits = case
    proxied = post(proxy(far_ce, dialect), path, body, headers)
    if (dialect, name) in CE_REFUSED:
        assert_refused(proxied, 400, client, CE_REFUSED[dialect, name])
        return
    far = post(far_ce, path, body, headers)
    assert far.status_code == proxied.status_code == 200, proxied.text
    same_reply(far.json(), proxied.json(), tokens=dialect not in NO_TOKEN_COUNTS)
    want = ce.score(ScoreRequest(**{"query": QUERY, "items": DOCS, **options})).scores
    assert_scores(proxied.json(), want, top_n, logits)


# Generative bodies: (id, path, body without label ids, client dialect, apply_softmax).
LM_CASES = [
    ("generative", "/generative_scoring", {"query": QUERY, "items": DOCS}, "vllm-generative", True),
    ("generative-full-vocab", "/generative_scoring", {"query": QUERY, "items": DOCS, "apply_softmax": False},
     "vllm-generative", False),
    ("generative-token-ids", "/generative_scoring", {"query": [11, 12, 13], "items": [[20, 21], [22], [23, 24]]},
     "vllm-generative", True),
    ("sglang-softmax", "/v1/score", {"query": QUERY, "items": DOCS, "apply_softmax": True}, "sglang-score", True),
    ("sglang-full-vocab", "/v1/score", {"query": QUERY, "items": DOCS}, "sglang-score", False),
]


@pytest.mark.parametrize("dialect", LM_DIALECTS, ids=str)
@pytest.mark.parametrize("case", LM_CASES, ids=[case[0] for case in LM_CASES])
def test_generative_bodies_through_the_proxy_answer_as_the_far_server(lm, far_lm, proxy, label_ids, dialect, case):
    _, path, body, client, apply_softmax = case
    body = {**body, "label_token_ids": label_ids}
    proxied = post(proxy(far_lm, dialect), path, body)
    if dialect == "vllm-generative" and client == "sglang-score":
        # SGLang answers every label's probability; vLLM's route gives the first label's only
        message, _ = assert_refused(proxied, 400, client, "label_token_ids")
        assert "vLLM /generative_scoring" in message
        return
    far = post(far_lm, path, body)
    assert far.status_code == proxied.status_code == 200, proxied.text
    same_reply(far.json(), proxied.json())
    want = lm.score(ScoreRequest(query=body["query"], items=body["items"], label_token_ids=label_ids,
                                 apply_softmax=apply_softmax, mode="generative", template="raw")).scores
    assert_scores(proxied.json(), want)


@pytest.mark.parametrize(("dialect", "path", "body", "client", "field"), [
    ("cohere", "/v2/rerank", {"model": "m", "query": QUERY, "documents": ["d"] * 20}, "cohere", "documents"),
    ("vllm-rerank", "/v2/rerank", {"model": "m", "query": QUERY, "documents": ["d"] * 20}, "cohere", "documents"),
    ("tei", "/rerank", {"query": QUERY, "texts": ["d"] * 20}, "tei", "texts"),
    ("sglang-rerank", "/v1/rerank", {"query": QUERY, "documents": ["d"] * 20}, "vllm-rerank", "documents"),
    (None, "/v1/rerank", {"query": QUERY, "documents": ["d"] * 20, "instruct": "x"}, "sglang-rerank", "documents"),
    (None, "/score", {"queries": QUERY, "documents": ["d"] * 20}, "vllm-score", "documents"),
])
def test_the_far_servers_item_limit_is_a_413_in_the_clients_dialect(far_ce, proxy, dialect, path, body, client,
                                                                     field):
    message, _ = assert_refused(post(proxy(far_ce, dialect), path, body), 413, client, field)
    assert f"the limit is {FAR_ITEM_LIMIT}" in message and "http://" not in message, message


def test_the_far_servers_400_keeps_its_message_and_field(far_lm, proxy):
    body = {"query": QUERY, "items": DOCS, "label_token_ids": [99999]}
    far = post(far_lm, "/generative_scoring", body)
    assert far.status_code == 400
    for dialect in ("vllm-generative", None):
        proxied = post(proxy(far_lm, dialect), "/generative_scoring", body)
        assert_refused(proxied, 400, "vllm-generative", "label_token_ids")
        assert proxied.json() == far.json(), "the far server's own error, without its URL"
    sglang = post(proxy(far_lm, "sglang-score"), "/v1/score", body)
    message, param = assert_refused(sglang, 400, "sglang-score", "label_token_ids")
    assert param == "label_token_ids" and "outside the vocabulary" in message


def test_what_the_proxy_cannot_forward_is_refused_naming_the_clients_field(far_ce, proxy):
    tei = proxy(far_ce, "tei")
    assert_refused(post(tei, "/v1/rerank", {"query": QUERY, "documents": DOCS, "instruct": "be strict"}), 400,
                   "sglang-rerank", "instruct")
    assert_refused(post(proxy(far_ce, "vllm-rerank"), "/rerank", {"query": QUERY, "texts": DOCS,
                                                                  "truncation_direction": "Left"}),
                   400, "tei", "truncation_direction")


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/score"])
def test_a_vllm_body_without_a_cut_goes_through_an_infinity_proxy(ce, far_ce, proxy, path):
    """vLLM's bodies that set no cut parse as truncation "none" (vLLM refuses an over-long prompt); Infinity, which
    cuts long documents itself, takes them rather than refusing every one."""
    body = {"queries": QUERY, "documents": DOCS} if path == "/score" else {"query": QUERY, "documents": DOCS}
    reply = post(proxy(far_ce, "infinity"), path, body)
    assert reply.status_code == 200, reply.text
    assert_scores(reply.json(), ce.score(ScoreRequest(query=QUERY, items=DOCS)).scores)


# (far fault, status the proxy answers, Retry-After): a refusal or a busy far server passes on (with the far server's
# Retry-After in whole seconds from 1 to 3600, else the proxy's own 1); anything else is the proxy's own failure to
# get an answer: 502.
FAULTS = [("400", 400, None), ("413", 413, None), ("422", 422, None), ("429:3", 429, "3"), ("503:3", 503, "3"),
          ("429", 429, "1"), ("503:2.5", 503, "3"), ("429:0", 429, "1"), ("429:86400", 429, "3600"),
          ("503:Wed, 21 Oct 2015 07:28:00 GMT", 503, "1"),
          ("500", 502, None), ("401", 502, None), ("404", 502, None), ("nan", 502, None), ("dup", 502, None),
          ("reset", 502, None)]


def test_far_server_statuses_come_back_as_typed_errors(servers):
    far = servers(script=[fault for fault, _, _ in FAULTS])
    backend = RemoteBackend(far.url, dialect="vllm-generative", served_model="fault-model", max_retries=0)
    body = {"query": "q", "items": ["doc 0", "doc 1"], "label_token_ids": [1, 2]}
    with live_server(create_app(backend, ServerConfig())) as url:
        for fault, status, retry_after in FAULTS:
            reply = post(url, "/generative_scoring", body)
            message, _ = assert_refused(reply, status, "vllm-generative", None)
            assert reply.headers.get("retry-after") == retry_after, fault
            assert reply.json()["error"]["code"] == status
            if status != 502:
                assert message == f"fault {status}", "the far server's own message"
        ok = post(url, "/generative_scoring", body)
        models = httpx.get(url + "/v1/models", timeout=5).json()
    assert ok.status_code == 200 and [row["score"] for row in ok.json()["data"]] == [0.0, 0.001]
    assert ok.json()["model"] == "fault-model" and models["data"][0]["id"] == "fault-model"
    backend.close()


def test_a_far_server_that_is_down_is_a_502_and_the_proxy_stays_up(dead_url):
    backend = RemoteBackend(dead_url, dialect="cohere", max_retries=0)
    with live_server(create_app(backend, ServerConfig())) as url:
        rerank = post(url, "/v2/rerank", {"model": "m", "query": QUERY, "documents": DOCS})
        health = httpx.get(url + "/health", timeout=5)
        models = httpx.get(url + "/v1/models", timeout=5)
    assert_refused(rerank, 502, "cohere", None)
    assert health.status_code == 503, "not ready: the far server is down"
    assert health.json()["error"]["message"] == f"far server {dead_url} is unreachable (ConnectError)"
    assert models.status_code == 200
    assert models.json()["data"][0]["id"] == dead_url, "no name to learn: the URL, never a 500"
    backend.close()


def test_health_and_models_on_the_proxy(far_ce, proxy):
    learnt = proxy(far_ce, "tei")  # TEI's replies name no model: it is read from the far server's /v1/models
    named = proxy(far_ce, "tei", config=ServerConfig(served_model_name="front"))
    for url, name in ((learnt, "tiny-ce"), (named, "front")):
        assert httpx.get(url + "/health", timeout=5).json() == {"status": "ok"}
        models = httpx.get(url + "/v1/models", timeout=5).json()
        assert [(model["id"], model["owned_by"]) for model in models["data"]] == [(name, "rerankit")]
        reply = post(url, "/rerank", {"query": QUERY, "documents": DOCS})  # vLLM's body: its reply has a model
        assert reply.status_code == 200 and reply.json()["model"] == name
    assert public_model_name("http://user:secret@far:8000/v1") == "http://far:8000/v1"


def test_api_keys_on_both_hops(ce, proxy):
    with live_server(create_app(ce, ServerConfig(served_model_name="tiny-ce", api_key="far-key"))) as far:
        keyed = proxy(far, "cohere", config=ServerConfig(api_key="proxy-key"), api_key="far-key", max_retries=0)
        keyless = proxy(far, "cohere", served_model="tiny-ce", max_retries=0)
        body = {"model": "tiny-ce", "query": QUERY, "documents": DOCS}
        ok = post(keyed, "/v2/rerank", body, {"Authorization": "Bearer proxy-key"})
        wrong = post(keyed, "/v2/rerank", body, {"Authorization": "Bearer far-key"})
        unkeyed = post(keyless, "/v2/rerank", body)
    assert ok.status_code == 200, ok.text
    assert_scores(ok.json(), ce.score(ScoreRequest(query=QUERY, items=DOCS)).scores)
    assert_refused(wrong, 401, "cohere", None)
    assert wrong.headers["www-authenticate"] == "Bearer"
    # the proxy's key to the far server is wrong: its fault, not the client's (no 401 telling the client to log in)
    message, _ = assert_refused(unkeyed, 502, "cohere", None)
    assert "HTTP 401" in message and "www-authenticate" not in unkeyed.headers


def test_discovery_picks_a_far_route_that_honours_each_body(ce, lm, far_ce, far_lm, proxy, label_ids):
    """With no dialect the proxy reads the far rerankit server's /openapi.json and /v1/models: label ids go to
    /generative_scoring, or to SGLang's /v1/score when every label's probability is asked; pooled hidden states
    to SGLang's /v1/score; texts to /score."""
    with RemoteBackend(far_ce) as remote:
        plain = remote.score(ScoreRequest(query=QUERY, items=DOCS))
        assert remote.model_name == "tiny-ce"
    assert plain.scores == pytest.approx(ce.score(ScoreRequest(query=QUERY, items=DOCS)).scores, abs=TOLERANCE)
    body = {"query": QUERY, "items": DOCS, "apply_softmax": True, "return_pooled_hidden_states": True}
    far, proxied = post(far_ce, "/v1/score", body), post(proxy(far_ce, None), "/v1/score", body)
    assert far.status_code == proxied.status_code == 200, proxied.text
    same_reply(far.json(), proxied.json())
    assert len(proxied.json()["pooled_hidden_states"]) == len(DOCS)
    with RemoteBackend(far_lm) as remote:
        labels = remote.score(ScoreRequest(query=QUERY, items=DOCS, label_token_ids=label_ids,
                                           return_label_logprobs=True))
    local = lm.score(ScoreRequest(query=QUERY, items=DOCS, label_token_ids=label_ids, return_label_logprobs=True,
                                  mode="generative", template="raw"))
    for got, want in zip(labels.results, local.results):
        assert got.label_logprobs == pytest.approx(want.label_logprobs, abs=TOLERANCE)


def test_rerankit_client_through_a_discovered_proxy(ce, far_ce, proxy):
    """Two hops of discovery: the client reads the proxy's routes, the proxy the far server's."""
    with Reranker(proxy(far_ce, None)) as reranker:
        hits = reranker.rank(QUERY, DOCS, top_n=3)
    want = ce.score(ScoreRequest(query=QUERY, items=DOCS)).scores
    assert [hit.index for hit in hits] == sorted(range(len(DOCS)), key=lambda index: -want[index])[:3]
    assert [hit.score for hit in hits] == pytest.approx([want[hit.index] for hit in hits], abs=TOLERANCE)
    assert [hit.text for hit in hits] == [DOCS[hit.index] for hit in hits]


def test_a_request_split_by_the_proxy_comes_back_whole(ce, far_ce, proxy):
    url = proxy(far_ce, "vllm-rerank", max_items_per_request=2)  # 5 documents: 3 far requests
    for body, top_n in (({"model": "m", "query": QUERY, "documents": DOCS, "top_n": 3}, 3),
                        ({"model": "m", "query": QUERY, "documents": DOCS}, None)):
        proxied, far = post(url, "/v2/rerank", body), post(far_ce, "/v2/rerank", body)
        assert proxied.status_code == 200, proxied.text
        same_reply(far.json(), proxied.json())
        assert_scores(proxied.json(), ce.score(ScoreRequest(query=QUERY, items=DOCS)).scores, top_n)


def test_concurrent_clients_each_get_their_own_items_back(ce, far_ce, proxy):
    url = proxy(far_ce, None)
    requests = [DOCS[i % 5:] + DOCS[:i % 5] for i in range(16)]

    def one(documents: list[str]) -> tuple[list[str], Any]:
        reply = post(url, "/v2/rerank", {"model": "m", "query": QUERY, "documents": documents})
        assert reply.status_code == 200, reply.text
        return documents, reply.json()

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(one, requests))
    for documents, reply in replies:
        assert_scores(reply, ce.score(ScoreRequest(query=QUERY, items=documents)).scores)


def test_cohere_sdk_against_the_proxy(ce, far_ce, proxy):
    cohere = pytest.importorskip("cohere")
    url = proxy(far_ce, None)
    want = ce.score(ScoreRequest(query=QUERY, items=DOCS)).scores
    reply = cohere.ClientV2(api_key="unused", base_url=url).rerank(model="tiny-ce", query=QUERY, documents=DOCS,
                                                                   top_n=3)
    assert_scores({"results": [{"index": r.index, "relevance_score": r.relevance_score} for r in reply.results]},
                  want, top_n=3)
    assert reply.meta.tokens.input_tokens > 0
    v1 = cohere.Client(api_key="unused", base_url=url)
    titled = v1.rerank(model="tiny-ce", query=QUERY, documents=TITLED, rank_fields=["title", "text"],
                       return_documents=True)
    scored = ce.score(ScoreRequest(query=QUERY, items=[f"title: Doc {i}\ntext: {text}"
                                                       for i, text in enumerate(DOCS)])).scores
    assert_scores({"results": [{"index": r.index, "relevance_score": r.relevance_score} for r in titled.results]},
                  scored)
    assert [(r.document.title, r.document.text) for r in titled.results] == [
        (f"Doc {r.index}", DOCS[r.index]) for r in titled.results]
    with pytest.raises(cohere.core.ApiError) as refused:
        cohere.ClientV2(api_key="unused", base_url=url).rerank(model="tiny-ce", query=QUERY, documents=["d"] * 20)
    assert refused.value.status_code == 413
    assert refused.value.body["message"].startswith("documents: holds 20 items")
