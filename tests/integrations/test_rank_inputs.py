"""``Reranker.rank`` and the LangChain compressor take any iterable of documents and pair each score with the text
it was scored as; a single string is refused, not split into characters."""

from __future__ import annotations

import asyncio

import pytest
from fake_backends import DOCUMENTS, QUERY, WordOverlapBackend

from rerankit import InvalidRequest, Reranker


def expected(documents: list[str], top_n: int | None = None) -> list[tuple[int, str]]:
    ranked = Reranker(backend=WordOverlapBackend()).rank(QUERY, list(documents), top_n=top_n)
    return [(hit.index, hit.text) for hit in ranked]


@pytest.mark.parametrize("make", [tuple, iter, lambda docs: (doc for doc in docs), lambda docs: dict.fromkeys(docs)])
def test_rank_takes_any_iterable_and_keeps_each_text_with_its_score(make):
    reranker = Reranker(backend=WordOverlapBackend())
    hits = reranker.rank(QUERY, make(DOCUMENTS), top_n=3)
    assert [(hit.index, hit.text) for hit in hits] == expected(DOCUMENTS, 3)
    hits = asyncio.run(reranker.arank(QUERY, make(DOCUMENTS)))
    assert [(hit.index, hit.text) for hit in hits] == expected(DOCUMENTS)


def test_rank_of_a_pandas_series_with_its_own_index_pairs_texts_by_position():
    pandas = pytest.importorskip("pandas")
    series = pandas.Series(DOCUMENTS).sort_values()  # labels out of order
    reranker = Reranker(backend=WordOverlapBackend())
    for documents in (series, series[series.str.len() > 35]):  # labels with gaps
        hits = reranker.rank(QUERY, documents)
        assert [(hit.index, hit.text) for hit in hits] == expected(list(documents))


@pytest.mark.parametrize("documents", ["Paris", b"Paris"])
def test_a_single_string_is_refused_not_split_into_characters(documents):
    backend = WordOverlapBackend()
    with pytest.raises(InvalidRequest) as error:
        Reranker(backend=backend).rank(QUERY, documents)
    assert error.value.field == "items" and not backend.calls


@pytest.mark.parametrize("top_n", [2.0, "2"])
def test_top_n_is_taken_as_the_request_validated_it(top_n):
    hits = Reranker(backend=WordOverlapBackend()).rank(QUERY, DOCUMENTS, top_n=top_n)
    assert [(hit.index, hit.text) for hit in hits] == expected(DOCUMENTS, 2)


def test_the_langchain_compressor_takes_a_generator_of_documents():
    from langchain_core.documents import Document

    from rerankit.integrations.langchain import RerankitRerank

    compressor = RerankitRerank(backend=WordOverlapBackend(), top_n=2)
    documents = [Document(page_content=text, metadata={"n": number}) for number, text in enumerate(DOCUMENTS)]
    from_list = compressor.compress_documents(documents, QUERY)
    from_generator = compressor.compress_documents((document for document in documents), QUERY)
    assert [(d.page_content, d.metadata) for d in from_generator] == [(d.page_content, d.metadata) for d in from_list]
    from_async = asyncio.run(compressor.acompress_documents(iter(documents), QUERY))
    assert [d.page_content for d in from_async] == [d.page_content for d in from_list]


@pytest.mark.parametrize(("query", "documents", "field"), [
    ("q", ["fine", "bad \ud800 text"], "items"), ("bad \udfff", ["fine"], "query"), ("q", ["é", "\ud83d"], "items"),
])
def test_a_lone_surrogate_is_refused_by_field_before_any_tokenizer(query, documents, field):
    backend = WordOverlapBackend()
    with pytest.raises(InvalidRequest) as error:
        Reranker(backend=backend).rank(query, documents)
    assert error.value.field == field and "surrogate" in error.value.reason and not backend.calls
    assert Reranker(backend=backend).rank("q", ["é ü 😀", "plain"])  # other non-ASCII text is fine


def test_the_cli_refuses_a_lone_surrogate_in_one_line(tmp_path):
    import subprocess
    import sys

    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "\\ud800"}\n{"text": "fine"}\n')
    done = subprocess.run([sys.executable, "-m", "rerankit", "rank", "--query", "q", "--docs", str(docs)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "surrogate" in done.stderr, done.stderr


def test_adapters_pickle_with_their_model_and_refuse_to_without_a_ready_backend():
    import pickle

    from llama_index.core.ingestion import IngestionPipeline

    from rerankit.integrations import langchain, llama_index

    for adapter in (langchain.RerankitRerank, llama_index.RerankitRerank, langchain.RerankitEmbeddings,
                    llama_index.RerankitEmbedding):
        copy = pickle.loads(pickle.dumps(adapter(model="/models/my-reranker", backend_options={"device": "cpu"})))
        assert (copy.model, copy._backend._model, copy._backend._options) == (
            "/models/my-reranker", "/models/my-reranker", {"device": "cpu"})
        # a ready backend cannot travel: pickled without it, LlamaIndex would build the adapter with the default model
        with pytest.raises(TypeError, match="ready reranker or backend"):
            pickle.dumps(adapter(backend=WordOverlapBackend()))
    with pytest.raises(TypeError, match="ready reranker or backend"):
        pickle.dumps(llama_index.RerankitRerank(reranker=Reranker(backend=WordOverlapBackend())))
    embedding = llama_index.RerankitEmbedding(backend=WordOverlapBackend())
    assert embedding.model_name == "word-overlap"
    with pytest.raises(TypeError, match="ready reranker or backend"):
        pickle.dumps(IngestionPipeline(transformations=[embedding]).transformations)


@pytest.mark.parametrize("model", ["my model", "a/b/c d", [], 5, ["http://a:1", 3]])
def test_a_model_that_is_no_folder_hub_id_or_url_is_a_model_load_error(model):
    from rerankit import ModelLoadError

    with pytest.raises(ModelLoadError):
        Reranker(model)


def test_a_path_object_names_a_folder(tmp_path):
    from rerankit import ModelLoadError

    with pytest.raises(ModelLoadError, match="no model folder"):
        Reranker(tmp_path / "missing" / "model")


def test_a_ready_backend_takes_no_model_or_options_beside_it():
    with pytest.raises(InvalidRequest, match="would be ignored beside a ready backend") as error:
        Reranker("/some/model", backend=WordOverlapBackend(), device="cuda")
    assert error.value.field == "model"
    with pytest.raises(InvalidRequest, match="dtype"):
        Reranker(backend=WordOverlapBackend(), dtype="nonsense")


def test_a_reranker_says_why_it_cannot_be_copied_or_pickled():
    import copy
    import pickle

    reranker = Reranker(backend=WordOverlapBackend())
    for attempt in (lambda: pickle.dumps(reranker), lambda: copy.deepcopy(reranker), lambda: copy.copy(reranker)):
        with pytest.raises(TypeError, match="make one in each process"):
            attempt()
