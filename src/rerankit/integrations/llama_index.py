"""LlamaIndex adapters: ``RerankitRerank``, a node postprocessor that reorders retrieved nodes, and
``RerankitEmbedding``, embeddings from a bi-encoder (the packaged MiniLM by default) for an index.

Needs only ``llama-index-core``. The model loads (or the connection opens) on the first call, not on import.

>>> query_engine = index.as_query_engine(similarity_top_k=20, node_postprocessors=[RerankitRerank(top_n=3)])
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List, Optional

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import ConfigDict, model_validator
from llama_index.core.callbacks import CBEventType, EventPayload
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.rerank import ReRankEndEvent, ReRankStartEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from rerankit.backend import Backend
from rerankit.defaults import DEFAULT_MODEL_NAME, default_model_path
from rerankit.errors import InvalidRequest, ModelLoadError
from rerankit.integrations import EmbedSettings, RerankSettings, aembed_texts, embed_texts
from rerankit.schema import ScoreRequest, ScoreResponse

dispatcher = get_dispatcher(__name__)


class RerankitRerank(RerankSettings, BaseNodePostprocessor):
    """Reranks nodes with rerankit and keeps the ``top_n`` best, with ``NodeWithScore.score`` set to the new score.

    Give a ``model`` with ``backend_options``, or a ready ``reranker`` or ``backend`` (see ``RerankSettings``).
    The input nodes are not modified: new ``NodeWithScore`` objects wrap the same nodes.
    """

    model_config = ConfigDict(extra="forbid")  # LlamaIndex's base ignores unknown fields: a typo would pass

    @classmethod
    def class_name(cls) -> str:
        return "RerankitRerank"

    def _postprocess_nodes(self, nodes: List[NodeWithScore],
                           query_bundle: Optional[QueryBundle] = None) -> List[NodeWithScore]:
        query = _query_text(query_bundle)
        if not nodes:
            return []
        backend = self._backend.get()
        with self._reranking_events(nodes, query_bundle, backend.model_name) as reranked:
            reranked.extend(_ranked_nodes(nodes, backend.score(self._request(nodes, query)), self.top_n))
        return reranked

    async def _apostprocess_nodes(self, nodes: List[NodeWithScore],
                                  query_bundle: Optional[QueryBundle] = None) -> List[NodeWithScore]:
        query = _query_text(query_bundle)
        if not nodes:
            return []
        backend = await self._backend.aget()
        with self._reranking_events(nodes, query_bundle, backend.model_name) as reranked:
            reranked.extend(_ranked_nodes(nodes, await backend.ascore(self._request(nodes, query)), self.top_n))
        return reranked

    def _request(self, nodes: List[NodeWithScore], query: str) -> ScoreRequest:
        items = [node.node.get_content(metadata_mode=MetadataMode.EMBED) for node in nodes]
        return ScoreRequest(query=query, items=items, top_n=self.top_n, **self.request_options)

    @contextmanager
    def _reranking_events(self, nodes: List[NodeWithScore], query_bundle: QueryBundle,
                          model_name: str) -> Iterator[List[NodeWithScore]]:
        """The events LlamaIndex's own rerankers emit: instrumentation start/end around a RERANKING callback.

        Yields the list the caller fills with the reranked nodes.
        """
        top_n = self.top_n if self.top_n is not None else len(nodes)
        dispatcher.event(ReRankStartEvent(query=query_bundle, nodes=nodes, top_n=top_n, model_name=model_name))
        reranked: List[NodeWithScore] = []
        with self.callback_manager.event(CBEventType.RERANKING, payload={
            EventPayload.NODES: nodes,
            EventPayload.MODEL_NAME: model_name,
            EventPayload.QUERY_STR: query_bundle.query_str,
            EventPayload.TOP_K: top_n,
        }) as event:
            yield reranked
            event.on_end(payload={EventPayload.NODES: reranked})
        dispatcher.event(ReRankEndEvent(nodes=reranked))


class RerankitEmbedding(EmbedSettings, BaseEmbedding):
    """LlamaIndex embeddings from a bi-encoder run by rerankit: the packaged all-MiniLM-L6-v2 when ``model`` is None.

    Give a ``model`` with ``backend_options``, or a ready ``backend`` (see ``EmbedSettings``); ``model_name``
    (for LlamaIndex's events) follows ``model``.
    """

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _name_after_model(self) -> "RerankitEmbedding":
        if self.model_name == "unknown":
            given = _backend_name(self.backend) if self.backend is not None else None
            self.model_name = self.model or given or DEFAULT_MODEL_NAME
        return self

    @classmethod
    def class_name(cls) -> str:
        return "RerankitEmbedding"

    def _get_query_embedding(self, query: str) -> Embedding:
        return embed_texts(self._backend, [query])[0]

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return (await aembed_texts(self._backend, [query]))[0]

    def _get_text_embedding(self, text: str) -> Embedding:
        return embed_texts(self._backend, [text])[0]

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return (await aembed_texts(self._backend, [text]))[0]

    def _get_text_embeddings(self, texts: List[str]) -> List[Embedding]:
        return embed_texts(self._backend, texts)

    async def _aget_text_embeddings(self, texts: List[str]) -> List[Embedding]:
        return await aembed_texts(self._backend, texts)


def _backend_name(backend: Backend) -> str:
    """A ready backend's model, the packaged MiniLM by its name rather than its folder."""
    try:
        packaged = default_model_path()
    except ModelLoadError:  # not installed: the backend's model is another
        packaged = None
    return DEFAULT_MODEL_NAME if backend.model_name == packaged else backend.model_name


def _query_text(query_bundle: Optional[QueryBundle]) -> str:
    if query_bundle is None:
        raise InvalidRequest("query_bundle", "reranking needs the query: pass query_bundle or query_str")
    return query_bundle.query_str


def _ranked_nodes(nodes: List[NodeWithScore], response: ScoreResponse, top_n: Optional[int]) -> List[NodeWithScore]:
    return [NodeWithScore(node=nodes[result.index].node, score=result.score) for result in response.ranked(top_n)]
