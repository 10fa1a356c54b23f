"""LlamaIndex adapter: mapping and event tests over a fake backend, then the real MiniLM in a retrieval pipeline."""

from __future__ import annotations

import pydantic
import pytest
from fake_backends import CORPUS, DOCUMENTS, QUERY, WordOverlapBackend
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.rerank import ReRankEndEvent, ReRankStartEvent
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from rerankit.errors import InvalidRequest
from rerankit.integrations.llama_index import RerankitEmbedding, RerankitRerank
from rerankit.schema import ScoreRequest, ScoreResponse


def _nodes() -> list[NodeWithScore]:
    return [NodeWithScore(node=TextNode(text=text, id_=f"node-{index}"), score=0.5)
            for index, text in enumerate(DOCUMENTS)]


class RecordingHandler(BaseEventHandler):
    """Keeps every instrumentation event the root dispatcher sees."""

    events: list = []

    @classmethod
    def class_name(cls) -> str:
        return "RecordingHandler"

    def handle(self, event, **kwargs) -> None:
        self.events.append(event)


@pytest.fixture
def rerank_events():
    """The ReRank start/end events dispatched while the test runs."""
    handler = RecordingHandler(events=[])
    root = get_dispatcher()
    root.add_event_handler(handler)
    yield handler.events
    root.event_handlers.remove(handler)


def test_postprocess_keeps_top_n_best_first_with_new_scores(overlap_backend):
    nodes = _nodes()

    ranked = RerankitRerank(backend=overlap_backend, top_n=3).postprocess_nodes(nodes, query_str=QUERY)

    assert [node.node.node_id for node in ranked] == ["node-1", "node-3", "node-4"]
    assert [node.score for node in ranked] == [5.0, 5.0, 4.0]
    assert all(node.score == 0.5 for node in nodes)
    assert ranked[0].node is nodes[1].node
    (kind, request), = overlap_backend.calls
    assert kind == "score" and request.items == DOCUMENTS and request.top_n == 3


async def test_apostprocess_scores_through_ascore(overlap_backend):
    ranked = await RerankitRerank(backend=overlap_backend, top_n=2).apostprocess_nodes(
        _nodes(), query_bundle=QueryBundle(QUERY))

    assert [node.node.node_id for node in ranked] == ["node-1", "node-3"]
    assert [kind for kind, _ in overlap_backend.calls] == ["ascore"]


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_missing_query_is_a_clear_error(overlap_backend, asynchronous):
    postprocessor = RerankitRerank(backend=overlap_backend)

    with pytest.raises(InvalidRequest, match="query_bundle"):
        if asynchronous:
            await postprocessor.apostprocess_nodes(_nodes())
        else:
            postprocessor.postprocess_nodes(_nodes())
    assert overlap_backend.calls == []


def test_empty_node_list_returns_empty_without_scoring(overlap_backend):
    assert RerankitRerank(backend=overlap_backend).postprocess_nodes([], query_str=QUERY) == []
    assert overlap_backend.calls == []


def test_node_text_includes_embed_metadata_like_the_builtin_rerankers(overlap_backend):
    node = NodeWithScore(node=TextNode(text="Paris", metadata={"country": "France"}))

    RerankitRerank(backend=overlap_backend).postprocess_nodes([node], query_str=QUERY)

    (_, request), = overlap_backend.calls
    assert "country: France" in request.items[0] and "Paris" in request.items[0]


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_rerank_events_match_the_builtin_rerankers(overlap_backend, rerank_events, asynchronous):
    debug = LlamaDebugHandler()
    postprocessor = RerankitRerank(backend=overlap_backend, top_n=2, callback_manager=CallbackManager([debug]))
    bundle = QueryBundle(QUERY)

    if asynchronous:
        ranked = await postprocessor.apostprocess_nodes(_nodes(), query_bundle=bundle)
    else:
        ranked = postprocessor.postprocess_nodes(_nodes(), query_bundle=bundle)

    start, end = [event for event in rerank_events if isinstance(event, (ReRankStartEvent, ReRankEndEvent))]
    assert isinstance(start, ReRankStartEvent) and isinstance(end, ReRankEndEvent)
    assert (start.query, start.top_n, start.model_name, len(start.nodes)) == (bundle, 2, "word-overlap", 5)
    assert end.nodes == ranked
    (start_cb, end_cb), = debug.get_event_pairs(CBEventType.RERANKING)
    assert start_cb.payload["model_name"] == "word-overlap" and start_cb.payload["query_str"] == QUERY
    assert end_cb.payload["nodes"] == ranked


def test_bad_settings_fail_at_construction(overlap_backend):
    with pytest.raises(pydantic.ValidationError, match="not model and backend"):
        RerankitRerank(model="some/model", backend=overlap_backend)
    with pytest.raises(pydantic.ValidationError, match="instrution"):
        RerankitRerank(request_options={"instrution": "typo"})
    with pytest.raises(pydantic.ValidationError, match="(?s)top_n.*not a boolean"):
        RerankitRerank(backend=overlap_backend, top_n=True)  # not one result


@pytest.mark.parametrize("adapter", [RerankitRerank, RerankitEmbedding])
def test_a_misspelt_setting_fails_at_construction(adapter):
    with pytest.raises(pydantic.ValidationError, match="topn"):
        adapter(topn=2)


def test_serializes_without_the_backend(overlap_backend):
    postprocessor = RerankitRerank(backend=overlap_backend, top_n=4)

    assert postprocessor.to_dict() == {"model": None, "top_n": 4, "backend_options": {}, "request_options": {},
                                       "class_name": "RerankitRerank"}


# --- the real engine on the packaged MiniLM ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm_index(minilm_backend) -> VectorStoreIndex:
    """The corpus embedded by the real MiniLM, one node a line."""
    documents = [Document(text=text, id_=f"corpus-{index}", metadata={"line": index})
                 for index, text in enumerate(CORPUS)]
    return VectorStoreIndex.from_documents(documents, embed_model=RerankitEmbedding(backend=minilm_backend))


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_query_engine_over_minilm_keeps_top_n_reranked_nodes(minilm_index, minilm_backend, rerank_events,
                                                                   asynchronous):
    engine = RetrieverQueryEngine.from_args(minilm_index.as_retriever(similarity_top_k=4), llm=MockLLM(),
                                            node_postprocessors=[RerankitRerank(backend=minilm_backend, top_n=2)])

    response = await engine.aquery(QUERY) if asynchronous else engine.query(QUERY)

    assert [node.node.metadata["line"] for node in response.source_nodes] == [0, 4]
    assert response.source_nodes[0].score > response.source_nodes[1].score > 0.3
    ends = [event for event in rerank_events if isinstance(event, ReRankEndEvent)]
    assert len(ends) == 1 and ends[0].nodes == response.source_nodes


async def test_retriever_then_postprocessor_rescore_with_the_default_model(minilm_index):
    candidates = minilm_index.as_retriever(similarity_top_k=len(CORPUS)).retrieve(QUERY)
    reranker = RerankitRerank(top_n=None)

    reranked = reranker.postprocess_nodes(candidates, query_str=QUERY)
    areranked = await reranker.apostprocess_nodes(candidates, query_str=QUERY)
    reranker.close()

    assert len(reranked) == len(CORPUS) and reranked[0].node.metadata["line"] == 0
    # The default reranker is the same MiniLM as the embeddings: its scores are the retrieval cosines.
    assert [node.score for node in reranked] == pytest.approx([node.score for node in candidates], abs=1e-5)
    assert [node.score for node in areranked] == pytest.approx([node.score for node in reranked], abs=1e-6)


def test_url_model_reranks_through_the_server(minilm_index, minilm_url, minilm_backend):
    candidates = minilm_index.as_retriever(similarity_top_k=4).retrieve(QUERY)
    local = RerankitRerank(backend=minilm_backend, top_n=3).postprocess_nodes(candidates, query_str=QUERY)
    remote = RerankitRerank(model=minilm_url, backend_options={"dialect": "vllm-rerank"}, top_n=3)

    served = remote.postprocess_nodes(candidates, query_str=QUERY)
    remote.close()

    assert [node.node.node_id for node in served] == [node.node.node_id for node in local]
    assert [node.score for node in served] == pytest.approx([node.score for node in local], abs=1e-5)


def test_embedding_model_name_follows_the_model(minilm_backend):
    assert RerankitEmbedding(backend=minilm_backend).model_name == "all-MiniLM-L6-v2 (packaged)"
    assert RerankitEmbedding(model="some/bi-encoder").model_name == "some/bi-encoder"


class EmbeddingBackend(WordOverlapBackend):
    """The word-overlap fake, with each item's length as its one-number embedding."""

    def _respond(self, request: ScoreRequest) -> ScoreResponse:
        response = super()._respond(request)
        for result in response.results:
            result.pooled_hidden_state = [float(len(request.items[result.index]))]
        return response


async def test_async_embeddings_go_through_ascore():
    backend = EmbeddingBackend()
    embedding = RerankitEmbedding(backend=backend)

    assert await embedding.aget_text_embedding("four") == [4.0]
    assert await embedding.aget_query_embedding("two") == [3.0]
    assert await embedding.aget_text_embedding_batch(["a", "bc"]) == [[1.0], [2.0]]
    assert [kind for kind, _ in backend.calls] == ["ascore"] * 3
