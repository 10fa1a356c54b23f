"""LangChain adapters: ``RerankitRerank``, a document compressor that reorders retrieved documents, and
``RerankitEmbeddings``, embeddings from a bi-encoder (the packaged MiniLM by default) for a vector store.

Needs only ``langchain-core``. The model loads (or the connection opens) on the first call, not on import.

>>> from langchain_classic.retrievers import ContextualCompressionRetriever
>>> retriever = ContextualCompressionRetriever(base_compressor=RerankitRerank(top_n=3),
...                                            base_retriever=vector_store.as_retriever(search_kwargs={"k": 20}))
"""

from __future__ import annotations

from copy import deepcopy
from typing import Sequence

from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document
from langchain_core.embeddings import Embeddings
from pydantic import ConfigDict

from rerankit.integrations import EmbedSettings, RerankSettings, aembed_texts, embed_texts
from rerankit.schema import ScoreRequest, ScoreResponse

RELEVANCE_SCORE = "relevance_score"


class RerankitRerank(RerankSettings, BaseDocumentCompressor):
    """Reranks documents with rerankit and keeps the ``top_n`` best, each scored in ``metadata["relevance_score"]``.

    Give a ``model`` with ``backend_options``, or a ready ``reranker`` or ``backend`` (see ``RerankSettings``).
    Input documents are never modified: the returned ones are copies.
    """

    model_config = ConfigDict(extra="forbid")

    def compress_documents(self, documents: Sequence[Document], query: str,
                           callbacks: Callbacks | None = None) -> Sequence[Document]:
        """The ``top_n`` documents most relevant to ``query``, best first, as scored copies."""
        documents = list(documents)  # any iterable: listed once, so that results index what was scored
        if not documents:
            return []
        response = self._backend.get().score(self._request(documents, query))
        return self._ranked_copies(documents, response)

    async def acompress_documents(self, documents: Sequence[Document], query: str,
                                  callbacks: Callbacks | None = None) -> Sequence[Document]:
        """Async twin of ``compress_documents``; scoring does not block the event loop."""
        documents = list(documents)
        if not documents:
            return []
        backend = await self._backend.aget()
        response = await backend.ascore(self._request(documents, query))
        return self._ranked_copies(documents, response)

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


class RerankitEmbeddings(EmbedSettings, Embeddings):
    """LangChain embeddings from a bi-encoder run by rerankit: the packaged all-MiniLM-L6-v2 when ``model`` is None.

    Give a ``model`` with ``backend_options``, or a ready ``backend``, e.g. the one a ``RerankitRerank`` shares
    (see ``EmbedSettings``).
    """

    model_config = ConfigDict(extra="forbid")

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
