"""The real client packages against ``rerankit serve`` on loopback: each gets its indexes and the scores of the
local ``Reranker`` back, in the shape it parses. A test is skipped when its package is not installed
(``pip install 'rerankit[compat]'``).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
from live_server import live_server
from server_fakes import RecordingBackend

from rerankit import Reranker
from rerankit.server.app import create_app
from rerankit.server.limits import ServerConfig

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital and most populous city of France.", "The quick brown fox jumps over the lazy dog.",
        "Gravity is a force that attracts two bodies towards each other.", "The capital of China is Beijing."]
MODEL = "tiny-ce"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def local(tiny_bert_cross_encoder):
    with Reranker(str(tiny_bert_cross_encoder)) as reranker:
        yield reranker


@pytest.fixture(scope="module")
def url(local):
    with live_server(create_app(local.backend, ServerConfig(served_model_name=MODEL))) as base:
        yield base


def true_scores(local: Reranker, documents: list[str] = DOCS) -> list[float]:
    return [ranked.score for ranked in sorted(local.rank(QUERY, documents), key=lambda ranked: ranked.index)]


def assert_ranked(pairs: list[tuple[int, float]], want: list[float], top_n: int | None = None) -> None:
    """(index, score) pairs best first, each the local score of that document, cut to top_n."""
    order = sorted(range(len(want)), key=lambda index: -want[index])[:top_n]
    assert [index for index, _ in pairs] == order
    for index, score in pairs:
        assert score == pytest.approx(want[index], abs=TOLERANCE)


def test_cohere_v2_client(url, local):
    cohere = pytest.importorskip("cohere")
    client = cohere.ClientV2(api_key="unused", base_url=url)
    reply = client.rerank(model=MODEL, query=QUERY, documents=DOCS, top_n=3, max_tokens_per_doc=256, priority=1)
    assert_ranked([(r.index, r.relevance_score) for r in reply.results], true_scores(local), top_n=3)
    assert reply.meta is not None and reply.meta.tokens.input_tokens > 0
    assert all(getattr(r, "document", None) is None for r in reply.results)
    # as Cohere's /v2/rerank answers (its API reference): the SDK reads version as a string
    assert (reply.meta.api_version.version, reply.meta.api_version.is_experimental) == ("2", False)


@pytest.mark.parametrize("client_name", ["ClientV2", "Client"])
def test_cohere_clients_top_n_true_is_refused_naming_it(url, client_name):
    """The SDK sends ``top_n=True`` as JSON ``true`` (its type is int, not checked); Cohere's API schema says
    ``integer``: refused as one, not taken as 1."""
    cohere = pytest.importorskip("cohere")
    client = getattr(cohere, client_name)(api_key="unused", base_url=url)
    with pytest.raises(cohere.BadRequestError) as refused:
        client.rerank(model=MODEL, query=QUERY, documents=DOCS, top_n=True)
    assert refused.value.body == {"message": "top_n: Input should be a valid integer, not a boolean"}


def test_cohere_v1_client_with_object_documents_and_rank_fields(url, local):
    cohere = pytest.importorskip("cohere")
    client = cohere.Client(api_key="unused", base_url=url)
    documents = [{"title": f"Doc {i}", "text": text} for i, text in enumerate(DOCS)]
    reply = client.rerank(model=MODEL, query=QUERY, documents=documents, rank_fields=["title", "text"],
                          max_chunks_per_doc=4, return_documents=True)
    scored = [f"title: Doc {i}\ntext: {text}" for i, text in enumerate(DOCS)]
    assert_ranked([(r.index, r.relevance_score) for r in reply.results], true_scores(local, scored))
    assert reply.meta is not None
    assert [r.document.text for r in reply.results] == [DOCS[r.index] for r in reply.results]
    assert [r.document.title for r in reply.results] == [f"Doc {r.index}" for r in reply.results]
    plain = client.rerank(model=MODEL, query=QUERY, documents=DOCS)
    assert_ranked([(r.index, r.relevance_score) for r in plain.results], true_scores(local))
    assert plain.meta is not None and all(r.document is None for r in plain.results)
    # the v1 Client posts to /v1/rerank, which Cohere answers as its v1 API: {"version": "1"}
    assert [reply.meta.api_version.version, plain.meta.api_version.version] == ["1", "1"]
    assert plain.meta.api_version.is_experimental is None


# Cohere's rule (its pricing, as Azure AI Foundry's Cohere Rerank page quotes it): a search unit is a query with up
# to 100 documents; a document longer than 500 tokens with its query counts once per chunk. LONG is cut to the tiny
# model's 512 positions, so each pair reads 512 tokens: 98 of them are 50,176 tokens, 101 chunks of 500.
LONG = "word " * 600


@pytest.mark.parametrize("client_name", ["ClientV2", "Client"])
@pytest.mark.parametrize(("count", "units"), [(3, 1), (100, 1), (101, 2)])
def test_cohere_clients_read_billed_search_units(url, client_name, count, units):
    cohere = pytest.importorskip("cohere")
    client = getattr(cohere, client_name)(api_key="unused", base_url=url)
    reply = client.rerank(model=MODEL, query=QUERY, documents=[DOCS[i % len(DOCS)] for i in range(count)])
    assert reply.meta.billed_units.search_units == units


def test_cohere_v2_client_bills_long_documents_by_their_chunks(url):
    """98 documents are one search unit, unless their tokens make more than 100 chunks of 500."""
    cohere = pytest.importorskip("cohere")
    client = cohere.ClientV2(api_key="unused", base_url=url)
    reply = client.rerank(model=MODEL, query="q", documents=[LONG] * 98)
    assert (reply.meta.tokens.input_tokens, reply.meta.billed_units.search_units) == (98 * 512, 2)
    assert client.rerank(model=MODEL, query="q", documents=["word"] * 98).meta.billed_units.search_units == 1


def test_cohere_v1_client_bills_each_window_of_max_chunks_per_doc(url):
    """With ``max_chunks_per_doc`` a long document is scored in windows, each billed as a document: 34 documents
    of 3 windows are 102."""
    cohere = pytest.importorskip("cohere")
    client = cohere.Client(api_key="unused", base_url=url)
    reply = client.rerank(model=MODEL, query="q", documents=["word " * 1200] * 34, max_chunks_per_doc=3)
    assert reply.meta.billed_units.search_units == 2
    cut = client.rerank(model=MODEL, query="q", documents=["word " * 1200] * 34)  # 34 pairs of 512 tokens
    assert cut.meta.billed_units.search_units == 1


def test_langchain_cohere_rerank(url, local):
    langchain_cohere = pytest.importorskip("langchain_cohere")
    reranker = langchain_cohere.CohereRerank(model=MODEL, base_url=url, cohere_api_key="unused", top_n=2)
    reply = reranker.rerank(DOCS, QUERY, top_n=None)
    assert_ranked([(r["index"], r["relevance_score"]) for r in reply], true_scores(local))


def _nodes(texts: list[str]):
    schema = pytest.importorskip("llama_index.core.schema")
    return [schema.NodeWithScore(node=schema.TextNode(text=text, id_=str(i))) for i, text in enumerate(texts)]


def _node_pairs(nodes) -> list[tuple[int, float]]:
    return [(int(node.node.id_), node.score) for node in nodes]


def test_llama_index_cohere_postprocessor(url, local):
    module = pytest.importorskip("llama_index.postprocessor.cohere_rerank")
    reranker = module.CohereRerank(api_key="unused", model=MODEL, top_n=3, base_url=url)
    nodes = reranker.postprocess_nodes(_nodes(DOCS), query_str=QUERY)
    assert_ranked(_node_pairs(nodes), true_scores(local), top_n=3)


def test_llama_index_tei_postprocessor(url, local):
    module = pytest.importorskip("llama_index.postprocessor.tei_rerank")
    reranker = module.TextEmbeddingInference(base_url=url, top_n=3)
    nodes = reranker.postprocess_nodes(_nodes(DOCS), query_str=QUERY)
    assert_ranked(_node_pairs(nodes), true_scores(local), top_n=3)


def test_llama_index_jina_postprocessor(url, local):
    module = pytest.importorskip("llama_index.postprocessor.jinaai_rerank")
    reranker = module.JinaRerank(api_key="unused", model=MODEL, top_n=3, base_url=f"{url}/v1")
    nodes = reranker.postprocess_nodes(_nodes(DOCS), query_str=QUERY)
    assert_ranked(_node_pairs(nodes), true_scores(local), top_n=3)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
def test_infinity_client(url, local, path):
    pytest.importorskip("infinity_client")
    from infinity_client import Client
    from infinity_client.api.default import rerank
    from infinity_client.models import RerankInput

    client = Client(base_url=url if path == "/rerank" else f"{url}/v1", timeout=30)
    result = rerank.sync(client=client, body=RerankInput(query=QUERY, documents=DOCS, return_documents=True,
                                                         top_n=3))
    assert_ranked([(r.index, r.relevance_score) for r in result.results], true_scores(local), top_n=3)
    assert [r.document for r in result.results] == [DOCS[r.index] for r in result.results]
    assert result.model == MODEL and result.usage.prompt_tokens > 0


# LiteLLM's rerank providers that take an api_base (cohere posts to /v2/rerank, infinity to /rerank, the others to
# /v1/rerank): one body for all of them (model, query, documents, top_n, return_documents true), each reply parsed
# its provider's way (Infinity's documents are strings, the others' objects).
LITELLM_PROVIDERS = ("cohere", "infinity", "jina_ai", "litellm_proxy", "azure_ai")


@pytest.mark.parametrize("provider", LITELLM_PROVIDERS)
def test_litellm_rerank(url, local, provider, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its import reads the packaged map, not the network
    litellm = pytest.importorskip("litellm")
    reply = litellm.rerank(model=f"{provider}/{MODEL}", query=QUERY, documents=DOCS, top_n=3, api_base=url,
                           api_key="unused")
    assert_ranked([(r["index"], r["relevance_score"]) for r in reply.results], true_scores(local), top_n=3)
    assert [r["document"]["text"] for r in reply.results] == [DOCS[r["index"]] for r in reply.results]
    if provider == "jina_ai":  # Jina's answer: its tokens, which LiteLLM bills
        assert reply.meta["billed_units"]["total_tokens"] > 0
    elif provider != "infinity":  # Cohere's, the same body without the SDK (azure_ai, litellm_proxy) included
        assert reply.meta["billed_units"]["search_units"] == 1


def raw_scores(local: Reranker, documents: list[str] = DOCS) -> list[float]:
    return [ranked.score for ranked in sorted(local.rank(QUERY, documents, raw_scores=True),
                                              key=lambda ranked: ranked.index)]


def test_langchain_nvidia_rerank(url, local):
    """A NIM client (``base_url`` of an on-premises NIM): /v1/models, then /v1/ranking; scores are logits."""
    nvidia = pytest.importorskip("langchain_nvidia_ai_endpoints")
    from langchain_core.documents import Document

    reranker = nvidia.NVIDIARerank(base_url=f"{url}/v1", model=MODEL, top_n=3, truncate="END")
    kept = reranker.compress_documents(query=QUERY, documents=[Document(page_content=text) for text in DOCS])
    assert_ranked([(DOCS.index(doc.page_content), doc.metadata["relevance_score"]) for doc in kept],
                  raw_scores(local), top_n=3)


def test_llama_index_nvidia_postprocessor(url, local):
    module = pytest.importorskip("llama_index.postprocessor.nvidia_rerank")
    reranker = module.NVIDIARerank(base_url=f"{url}/v1", model=MODEL, top_n=3)
    nodes = reranker.postprocess_nodes(_nodes(DOCS), query_str=QUERY)
    assert_ranked(_node_pairs(nodes), raw_scores(local), top_n=3)


@pytest.mark.parametrize("top_k", [None, 2])
def test_voyageai_client(url, local, top_k):
    voyageai = pytest.importorskip("voyageai")
    client = voyageai.Client(api_key="unused", base_url=f"{url}/v1", max_retries=0)
    reply = client.rerank(QUERY, DOCS, model=MODEL, top_k=top_k)
    assert_ranked([(r.index, r.relevance_score) for r in reply.results], true_scores(local), top_n=top_k)
    assert [r.document for r in reply.results] == [DOCS[r.index] for r in reply.results]
    assert reply.total_tokens > 0


def test_voyageai_client_error_reads_its_detail(url):
    voyageai = pytest.importorskip("voyageai")
    client = voyageai.Client(api_key="unused", base_url=f"{url}/v1", max_retries=0)
    with pytest.raises(voyageai.error.InvalidRequestError, match="documents"):
        client.rerank(QUERY, [], model=MODEL, top_k=1)


def test_remote_reranker_with_served_model(url, local):
    """The issue's ``Reranker(url, dialect="cohere", model=...)`` spelled ``served_model=``: sent as ``model``."""
    with Reranker(url, dialect="cohere", served_model=MODEL) as remote:
        assert [r.index for r in remote.rank(QUERY, DOCS)] == [r.index for r in local.rank(QUERY, DOCS)]
    with Reranker(url, dialect="cohere") as remote:  # the model from /v1/models
        assert remote.rank(QUERY, DOCS)[0].score == pytest.approx(max(true_scores(local)), abs=TOLERANCE)
        assert remote.model_name == MODEL


def test_vllm_body_dumped_with_nulls_and_unknown_fields_is_answered(url, local, caplog):
    """A vLLM ``RerankRequest.model_dump()``: every field, unset ones null, plus a field rerankit does not know."""
    httpx = pytest.importorskip("httpx")
    body = {"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 0, "user": None, "truncate_prompt_tokens": None,
            "truncation_side": None, "max_tokens_per_query": 0, "max_tokens_per_doc": 0, "instruction": None,
            "chat_template_kwargs": None, "use_activation": None, "priority": 0, "request_id": None,
            "mm_processor_kwargs": None, "cache_salt": None, "padding": None, "some_future_field": 1}
    with caplog.at_level(logging.DEBUG, logger="rerankit.server"):
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            reply = httpx.post(url + path, json=body, timeout=30)
            assert reply.status_code == 200, reply.text
            payload = reply.json()
            assert "usage" in payload and payload["results"][0]["document"]["text"] in DOCS  # vLLM's shape
            assert_ranked([(r["index"], r["relevance_score"]) for r in payload["results"]], true_scores(local))
    assert "some_future_field" in caplog.text


def test_cohere_v2_clients_priority_orders_the_queue():
    """The ``cohere`` SDK's ``priority`` (its docs: lower numbers are handled earlier) reaches rerankit serve's queue:
    while the engine is busy, a priority-0 call sent after three priority-5 calls runs before them."""
    cohere = pytest.importorskip("cohere")
    backend = RecordingBackend(hold_first_call=True)
    with live_server(create_app(backend, ServerConfig(max_batch_items=1, batch_window_ms=0))) as base:
        client = cohere.ClientV2(api_key="unused", base_url=base)

        def call(query: str, priority: int | None) -> None:
            extra = {} if priority is None else {"priority": priority}
            client.rerank(model=MODEL, query=query, documents=["x"], **extra)

        threads = [threading.Thread(target=call, args=("first", None))]
        threads[0].start()
        assert backend.entered.wait(10)
        for query, priority in (("batch-a", 5), ("batch-b", 5), ("batch-c", 5), ("interactive", 0)):
            threads.append(threading.Thread(target=call, args=(query, priority)))
            threads[-1].start()
            time.sleep(0.05)  # each queued before the next is sent
        backend.gate.set()
        for thread in threads:
            thread.join(20)
    assert [call[0] for call in backend.calls] == ["first", "interactive", "batch-a", "batch-b", "batch-c"]
