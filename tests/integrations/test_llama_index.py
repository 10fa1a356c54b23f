"""LlamaIndex adapter: mapping and event tests over a fake backend, then the real MiniLM in a retrieval pipeline."""

from __future__ import annotations

import pydantic
import pytest
from fake_backends import DOCUMENTS, QUERY
from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.rerank import ReRankEndEvent, ReRankStartEvent
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from rerankit.errors import InvalidRequest
from rerankit.integrations.llama_index import RerankitRerank


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


def test_serializes_without_the_backend(overlap_backend):
    postprocessor = RerankitRerank(backend=overlap_backend, top_n=4)

    assert postprocessor.to_dict() == {"model": None, "top_n": 4, "backend_options": {}, "request_options": {},
                                       "class_name": "RerankitRerank"}
