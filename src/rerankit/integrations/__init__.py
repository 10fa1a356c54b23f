"""Adapters for RAG frameworks: ``rerankit.integrations.langchain`` and ``rerankit.integrations.llama_index``.

This package imports neither framework; each adapter module imports only its own. Both frameworks' components
are pydantic models, so the settings their adapters share are pydantic models here (``RerankSettings``,
``EmbedSettings``) that each adapter mixes into its framework's base class.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from rerankit.backend import Backend
from rerankit.errors import RerankitError
from rerankit.reranker import Reranker, make_backend
from rerankit.schema import NoBoolNumbers, ScoreRequest, ScoreResponse

# Fields an adapter fills in itself from each call; request options may not override them.
PER_CALL_FIELDS = ("query", "items", "top_n")
# A bi-encoder embeds each item on its own, apart from the query; the schema still needs a query, so this
# short one stands in when only the items' embeddings are wanted.
EMBEDDING_QUERY = "query"


class LazyBackend:
    """The backend an adapter scores with, built on first use so that making an adapter never loads torch.

    Either wraps a ready ``backend`` (which the caller keeps owning) or builds one from ``model`` and
    ``options`` with ``make_backend`` (which ``close`` then releases).
    """

    def __init__(self, model: str | Sequence[str] | None = None, options: dict[str, Any] | None = None,
                 backend: Backend | None = None) -> None:
        self._model = model
        self._options = dict(options or {})
        self._backend = backend
        self._owned = backend is None
        self._lock = threading.Lock()

    def get(self) -> Backend:
        """The backend, built once even when several threads ask at the same time (read once: a ``close`` from
        another thread leaves this call the backend it found, whose use then says it is closed, never None)."""
        backend = self._backend
        if backend is None:
            with self._lock:
                if self._backend is None:
                    self._backend = make_backend(self._model, **self._options)
                backend = self._backend
        return backend

    async def aget(self) -> Backend:
        """``get`` for coroutines: a first call builds the backend on a worker thread, not on the event loop."""
        backend = self._backend
        if backend is not None:
            return backend
        return await asyncio.to_thread(self.get)

    def close(self) -> None:
        """Release a backend built here; one passed in is left to its owner."""
        with self._lock:
            if self._owned and self._backend is not None:
                self._backend.close()
                self._backend = None

    def __getstate__(self) -> dict[str, Any]:
        """What a copy in another process needs: the model and options, from which it builds its own backend; a
        ready backend passed in cannot travel (``TypeError``)."""
        if not self._owned:
            raise TypeError(NOT_PICKLED)
        return {"model": self._model, "options": self._options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["model"], state["options"])


NOT_PICKLED = ("an adapter given a ready reranker or backend cannot be pickled (a live model cannot go to another "
               "process, e.g. LlamaIndex's IngestionPipeline(num_workers=N)): give model= and backend_options= "
               "instead, and each process loads its own")


def refuse_pickling_ready(settings: "RerankSettings | EmbedSettings") -> None:
    """``TypeError`` where an adapter holds a ready reranker or backend: pickled without it, it would come back
    scoring with another model (LlamaIndex drops what it cannot pickle and builds the adapter again)."""
    if getattr(settings, "reranker", None) is not None or settings.backend is not None:
        raise TypeError(NOT_PICKLED)


def adapter_backend(model: str | Sequence[str] | None, backend_options: dict[str, Any],
                    reranker: Reranker | None, backend: Backend | None) -> LazyBackend:
    """The lazy backend of an adapter configured with one of ``model`` (+ options), ``reranker`` or ``backend``."""
    given = [name for name, value in (("model", model), ("reranker", reranker), ("backend", backend))
             if value is not None]
    if len(given) > 1:
        raise ValueError(f"give one of model, reranker or backend, not {' and '.join(given)}")
    if backend_options and given and given != ["model"]:
        raise ValueError("backend_options only apply to a backend built from model; "
                         f"pass them when building your {given[0]}")
    ready = backend if backend is not None else (reranker.backend if reranker is not None else None)
    return LazyBackend(model, backend_options, ready)


def check_request_options(request_options: dict[str, Any]) -> None:
    """Validate extra ScoreRequest fields at construction, so a typo fails there and not at the first query."""
    clashing = sorted(set(request_options) & set(PER_CALL_FIELDS))
    if clashing:
        raise ValueError(f"request_options may not set {', '.join(clashing)}: the adapter fills them in per call")
    ScoreRequest(query="query", items=["document"], **request_options)


def embedding_request(texts: list[str]) -> ScoreRequest:
    """A bi-encoder request whose results carry each text's pooled embedding."""
    return ScoreRequest(query=EMBEDDING_QUERY, items=texts, mode="bi-encoder", return_pooled_hidden_states=True)


def embeddings_of(response: ScoreResponse, model_name: str) -> list[list[float]]:
    """The pooled embedding of each item, in input order; an error if the backend sent none."""
    embeddings = [result.pooled_hidden_state for result in response.results]
    if any(embedding is None for embedding in embeddings):
        raise RerankitError(f"{model_name} returned no pooled embeddings: embeddings need a backend that returns "
                            "pooled hidden states in bi-encoder mode, such as the embedded engine")
    return embeddings  # type: ignore[return-value]


def embed_texts(lazy: LazyBackend, texts: list[str]) -> list[list[float]]:
    """One embedding per text, from the backend in bi-encoder mode."""
    if not texts:
        return []
    backend = lazy.get()
    return embeddings_of(backend.score(embedding_request(texts)), backend.model_name)


async def aembed_texts(lazy: LazyBackend, texts: list[str]) -> list[list[float]]:
    """Async twin of ``embed_texts``."""
    if not texts:
        return []
    backend = await lazy.aget()
    return embeddings_of(await backend.ascore(embedding_request(texts)), backend.model_name)


class RerankSettings(NoBoolNumbers):
    """What a reranking adapter is given: a ``model`` (path, hub id, server URL or list of URLs; None is the packaged
    MiniLM) with ``backend_options``, or an already-built ``reranker`` or ``backend``; ``top_n`` and extra request
    fields. The backend is built on first use. ``top_n=True`` is refused, as in a request (``NoBoolNumbers``).
    """

    model: str | list[str] | None = Field(default=None, description="Model path, hub id, or server URL(s).")
    top_n: int | None = Field(default=3, ge=1, description="How many to keep, best first; None keeps all.")
    backend_options: dict[str, Any] = Field(
        default_factory=dict, description="Options for the backend built from `model` (device, dtype, dialect, ...).")
    request_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra ScoreRequest fields (instruction, template, max_tokens_per_item, ...).")
    reranker: Reranker | None = Field(default=None, exclude=True, description="A ready Reranker to score with.")
    backend: Backend | None = Field(default=None, exclude=True, description="A ready Backend to score with.")

    model_config = ConfigDict(arbitrary_types_allowed=True)

    _backend: LazyBackend = PrivateAttr()

    @model_validator(mode="after")
    def _one_source_of_scores(self) -> "RerankSettings":
        check_request_options(self.request_options)
        self._backend = adapter_backend(self.model, self.backend_options, self.reranker, self.backend)
        return self

    def close(self) -> None:
        """Release the model or connections built from ``model``; a passed-in backend stays open."""
        self._backend.close()

    def __getstate__(self) -> dict[str, Any]:
        refuse_pickling_ready(self)
        return super().__getstate__()


class EmbedSettings(BaseModel):
    """What an embedding adapter is given: a bi-encoder ``model`` (path or hub id of a sentence-transformers model;
    None is the packaged all-MiniLM-L6-v2) with ``backend_options``, or a ready ``backend``. The model loads on
    first use.
    """

    model: str | None = Field(default=None, description="Bi-encoder path or hub id; None is the packaged MiniLM.")
    backend_options: dict[str, Any] = Field(default_factory=dict, description="Options for the embedded engine.")
    backend: Backend | None = Field(default=None, exclude=True, description="A ready Backend to embed with.")

    model_config = ConfigDict(arbitrary_types_allowed=True)

    _backend: LazyBackend = PrivateAttr()

    @model_validator(mode="after")
    def _one_source_of_embeddings(self) -> "EmbedSettings":
        self._backend = adapter_backend(self.model, self.backend_options, None, self.backend)
        return self

    def close(self) -> None:
        """Release a model built from ``model``; a passed-in backend stays open."""
        self._backend.close()

    def __getstate__(self) -> dict[str, Any]:
        refuse_pickling_ready(self)
        return super().__getstate__()
