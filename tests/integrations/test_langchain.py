"""LangChain adapter: mapping tests over a fake backend, then the real MiniLM inside a ContextualCompressionRetriever."""

from __future__ import annotations

import pydantic
import pytest
from fake_backends import DOCUMENTS, QUERY
from langchain_core.documents import Document

from rerankit.integrations.langchain import RerankitRerank
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
