"""LangChain adapter: mapping tests over a fake backend, then the real MiniLM inside a ContextualCompressionRetriever."""

from __future__ import annotations

import math

import pydantic
import pytest
from fake_backends import CORPUS, DOCUMENTS, QUERY
from langchain_classic.retrievers import ContextualCompressionRetriever
from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore

from rerankit.integrations.langchain import RerankitEmbeddings, RerankitRerank
from rerankit.reranker import Reranker


def _documents() -> list[Document]:
    return [Document(page_content=text, id=f"doc-{index}", metadata={"source": index, "tags": ["kept"]})
            for index, text in enumerate(DOCUMENTS)]


def test_compress_keeps_top_n_best_first_with_relevance_scores(overlap_backend):
    compressor = RerankitRerank(backend=overlap_backend, top_n=3)

    ranked = compressor.compress_documents(_documents(), QUERY)

    assert [document.id for document in ranked] == ["doc-1", "doc-3", "doc-4"]
    assert [document.metadata["relevance_score"] for document in ranked] == [5.0, 5.0, 4.0]
    assert [document.metadata["source"] for document in ranked] == [1, 3, 4]
    (kind, request), = overlap_backend.calls
    assert kind == "score" and request.query == QUERY and request.items == DOCUMENTS and request.top_n == 3


def test_input_documents_are_not_modified(overlap_backend):
    documents = _documents()

    ranked = RerankitRerank(backend=overlap_backend, top_n=None).compress_documents(documents, QUERY)
    ranked[0].metadata["tags"].append("changed downstream")

    assert len(ranked) == len(DOCUMENTS)
    assert all("relevance_score" not in document.metadata for document in documents)
    assert all(document.metadata["tags"] == ["kept"] for document in documents)
    assert {id(document) for document in ranked}.isdisjoint(id(document) for document in documents)


def test_empty_document_list_returns_empty_without_scoring(overlap_backend):
    compressor = RerankitRerank(backend=overlap_backend)

    assert compressor.compress_documents([], QUERY) == []
    assert overlap_backend.calls == []


async def test_acompress_scores_through_ascore(overlap_backend):
    compressor = RerankitRerank(backend=overlap_backend, top_n=2)

    ranked = await compressor.acompress_documents(_documents(), QUERY)

    assert [document.id for document in ranked] == ["doc-1", "doc-3"]
    assert [kind for kind, _ in overlap_backend.calls] == ["ascore"]
    assert await compressor.acompress_documents([], QUERY) == []


def test_request_options_reach_the_score_request(overlap_backend):
    compressor = RerankitRerank(backend=overlap_backend, request_options={"instruction": "Find the capital",
                                                                         "max_tokens_per_item": 64})

    compressor.compress_documents(_documents(), QUERY)

    (_, request), = overlap_backend.calls
    assert request.instruction == "Find the capital" and request.max_tokens_per_item == 64


def test_a_ready_reranker_scores_with_its_backend_and_stays_open(overlap_backend):
    compressor = RerankitRerank(reranker=Reranker(backend=overlap_backend), top_n=1)

    assert compressor.compress_documents(_documents(), QUERY)[0].id == "doc-1"
    compressor.close()
    assert not overlap_backend.closed


@pytest.mark.parametrize("settings, message", [
    ({"model": "some/model", "backend": "fake"}, "not model and backend"),
    ({"backend": "fake", "backend_options": {"device": "cpu"}}, "backend_options only apply"),
    ({"request_options": {"instrution": "typo"}}, "instrution"),
    ({"request_options": {"top_n": 2}}, "may not set top_n"),
    ({"top_n": 0}, "top_n"),
    ({"top_n": True}, "(?s)top_n.*not a boolean"),
])
def test_bad_settings_fail_at_construction(overlap_backend, settings, message):
    if settings.get("backend") == "fake":
        settings = {**settings, "backend": overlap_backend}

    with pytest.raises(pydantic.ValidationError, match=message):
        RerankitRerank(**settings)


def test_fields_serialize_without_the_backend(overlap_backend):
    compressor = RerankitRerank(backend=overlap_backend, top_n=5, request_options={"instruction": "x"})

    assert compressor.model_dump() == {"model": None, "top_n": 5, "backend_options": {},
                                       "request_options": {"instruction": "x"}}


# --- the real engine on the packaged MiniLM ---------------------------------------------------------------------

def _compression_retriever(backend, compressor: RerankitRerank, k: int = 4) -> ContextualCompressionRetriever:
    store = InMemoryVectorStore(RerankitEmbeddings(backend=backend))
    store.add_documents([Document(page_content=text, id=f"corpus-{index}", metadata={"line": index})
                         for index, text in enumerate(CORPUS)])
    return ContextualCompressionRetriever(base_retriever=store.as_retriever(search_kwargs={"k": k}),
                                          base_compressor=compressor)


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_compression_retriever_over_minilm_returns_top_n_best_first(minilm_backend, asynchronous):
    retriever = _compression_retriever(minilm_backend, RerankitRerank(backend=minilm_backend, top_n=2))

    found = await retriever.ainvoke(QUERY) if asynchronous else retriever.invoke(QUERY)

    assert [document.id for document in found] == ["corpus-0", "corpus-4"]
    assert [document.metadata["line"] for document in found] == [0, 4]
    assert found[0].metadata["relevance_score"] > found[1].metadata["relevance_score"] > 0.3


def test_relevance_scores_are_the_cosines_of_the_minilm_embeddings(minilm_backend):
    embeddings = RerankitEmbeddings(backend=minilm_backend)
    query_vector = embeddings.embed_query(QUERY)
    document_vectors = embeddings.embed_documents(CORPUS)

    ranked = RerankitRerank(backend=minilm_backend, top_n=None).compress_documents(
        [Document(page_content=text, metadata={"line": index}) for index, text in enumerate(CORPUS)], QUERY)

    assert len(query_vector) == 384 and len(document_vectors) == len(CORPUS)
    for document in ranked:
        vector = document_vectors[document.metadata["line"]]
        cosine = sum(a * b for a, b in zip(query_vector, vector)) / math.hypot(*query_vector) / math.hypot(*vector)
        assert document.metadata["relevance_score"] == pytest.approx(cosine, abs=1e-5)
    assert embeddings.embed_documents([]) == []


def test_default_model_is_the_packaged_minilm_loaded_on_first_query():
    compressor = RerankitRerank(top_n=1)

    best, = compressor.compress_documents([Document(page_content=text) for text in CORPUS], QUERY)
    compressor.close()

    assert best.page_content == CORPUS[0]


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_url_model_scores_through_the_server_like_the_local_engine(minilm_backend, minilm_url, asynchronous):
    documents = [Document(page_content=text) for text in CORPUS]
    local = RerankitRerank(backend=minilm_backend, top_n=3).compress_documents(documents, QUERY)
    remote = RerankitRerank(model=minilm_url, backend_options={"dialect": "cohere"}, top_n=3)

    served = await remote.acompress_documents(documents, QUERY) if asynchronous else \
        remote.compress_documents(documents, QUERY)
    remote.close()

    assert [document.page_content for document in served] == [document.page_content for document in local]
    assert [document.metadata["relevance_score"] for document in served] == pytest.approx(
        [document.metadata["relevance_score"] for document in local], abs=1e-5)
