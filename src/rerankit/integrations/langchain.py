"""LangChain adapters: ``RerankitRerank``, a document compressor that reorders retrieved documents, and
``RerankitEmbeddings``, embeddings from a bi-encoder (the packaged MiniLM by default) for a vector store.

Needs only ``langchain-core``. The model loads (or the connection opens) on the first call, not on import.

>>> from langchain_classic.retrievers import ContextualCompressionRetriever
>>> retriever = ContextualCompressionRetriever(base_compressor=RerankitRerank(top_n=3),
...                                            base_retriever=vector_store.as_retriever(search_kwargs={"k": 20}))
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any, Sequence

from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document
from langchain_core.embeddings import Embeddings
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from rerankit.backend import Backend
from rerankit.integrations import (LazyBackend, adapter_backend, aembed_texts, check_request_options,
                                  embed_texts)
from rerankit.reranker import Reranker
from rerankit.schema import ScoreRequest, ScoreResponse

RELEVANCE_SCORE = "relevance_score"


class RerankitRerank(BaseDocumentCompressor):
    """Reranks documents with rerankit and keeps the ``top_n`` best, each scored in ``metadata["relevance_score"]``.

    Give a ``model`` (path, hub id, server URL or list of URLs; None is the packaged MiniLM) with
    ``backend_options``, or an already-built ``reranker`` or ``backend``. Input documents are never modified:
    the returned ones are copies.
    """

    model: str | list[str] | None = Field(default=None, description="Model path, hub id, or server URL(s).")
    top_n: int | None = Field(default=3, ge=1, description="How many documents to keep; None keeps all.")
    backend_options: dict[str, Any] = Field(
        default_factory=dict, description="Options for the backend built from `model` (device, dtype, dialect, ...).")
    request_options: dict[str, Any] = Field(
        default_factory=dict, description="Extra ScoreRequest fields (instruction, template, max_tokens_per_item, ...).")
    reranker: Reranker | None = Field(default=None, exclude=True, description="A ready Reranker to score with.")
    backend: Backend | None = Field(default=None, exclude=True, description="A ready Backend to score with.")

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    _backend: LazyBackend = PrivateAttr()

    @model_validator(mode="after")
    def _one_source_of_scores(self) -> "RerankitRerank":
        check_request_options(self.request_options)
        self._backend = adapter_backend(self.model, self.backend_options, self.reranker, self.backend)
        return self

    def compress_documents(self, documents: Sequence[Document], query: str,
                           callbacks: Callbacks | None = None) -> Sequence[Document]:
        """The ``top_n`` documents most relevant to ``query``, best first, as scored copies."""
        if not documents:
            return []
        response = self._backend.get().score(self._request(documents, query))
        return self._ranked_copies(documents, response)

    async def acompress_documents(self, documents: Sequence[Document], query: str,
                                  callbacks: Callbacks | None = None) -> Sequence[Document]:
        """Async twin of ``compress_documents``; scoring does not block the event loop."""
        if not documents:
            return []
        backend = await self._backend.aget()
        response = await backend.ascore(self._request(documents, query))
        return self._ranked_copies(documents, response)

    def close(self) -> None:
        """Release the model or connections built from ``model``; a passed-in backend stays open."""
        self._backend.close()

    def _request(self, documents: Sequence[Document], query: str) -> ScoreRequest:
        return ScoreRequest(query=query, items=[document.page_content for document in documents],
                            top_n=self.top_n, **self.request_options)

    def _ranked_copies(self, documents: Sequence[Document], response: ScoreResponse) -> list[Document]:
        ranked = []
        for result in response.ranked(self.top_n):
            original = documents[result.index]
            metadata = {**deepcopy(original.metadata), RELEVANCE_SCORE: result.score}
            ranked.append(original.model_copy(update={"metadata": metadata}))
        return ranked



class RerankitEmbeddings(BaseModel, Embeddings):
    """LangChain embeddings from a bi-encoder run by rerankit: the packaged all-MiniLM-L6-v2 when ``model`` is None.

    Give a ``model`` (path or hub id of a sentence-transformers model) with ``backend_options``, or a ready
    ``backend`` (e.g. the one a ``RerankitRerank`` shares). The model loads on the first call.
    """

    model: str | None = Field(default=None, description="Bi-encoder path or hub id; None is the packaged MiniLM.")
    backend_options: dict[str, Any] = Field(default_factory=dict, description="Options for the embedded engine.")
    backend: Backend | None = Field(default=None, exclude=True, description="A ready Backend to embed with.")

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    _backend: LazyBackend = PrivateAttr()

    @model_validator(mode="after")
    def _one_source_of_embeddings(self) -> "RerankitEmbeddings":
        self._backend = adapter_backend(self.model, self.backend_options, None, self.backend)
        return self

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """One embedding per text."""
        return embed_texts(self._backend, texts)

    def embed_query(self, text: str) -> list[float]:
        """The embedding of the query (the same encoder as the documents)."""
        return embed_texts(self._backend, [text])[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        """Async twin of ``embed_documents``."""
        return await aembed_texts(self._backend, texts)

    async def aembed_query(self, text: str) -> list[float]:
        """Async twin of ``embed_query``."""
        return (await aembed_texts(self._backend, [text]))[0]

    def close(self) -> None:
        """Release a model built from ``model``; a passed-in backend stays open."""
        self._backend.close()
