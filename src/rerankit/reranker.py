"""``Reranker``: the plain Python front. Picks an embedded engine or a remote client from ``model``."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path
from collections.abc import Iterable
from typing import Any, Sequence

from rerankit.backend import Backend
from rerankit.errors import InvalidRequest, ModelLoadError
from rerankit.schema import RankedDocument, ScoreRequest, ScoreResponse


def is_url(model: Any) -> bool:
    """True for an http(s) URL or a non-empty list of them."""
    if isinstance(model, str):
        return model.startswith(("http://", "https://"))
    return isinstance(model, (list, tuple)) and bool(model) and all(is_url(entry) for entry in model)


def missing_modules(*names: str) -> list[str]:
    """Which of the importable ``names`` are not installed (an extra that was not asked for)."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def check_model_source(model: Any) -> None:
    """For a local ``model`` (not a URL): ``ModelLoadError`` in one line, before torch loads, where it is a missing
    folder or a hub id neither cached nor reachable (``hub.check_source``)."""
    if isinstance(model, str) and not is_url(model) and not Path(model).expanduser().exists():
        from rerankit.hub import check_source

        check_source(model)


def make_backend(model: str | Sequence[str] | None = None, **options: Any) -> Backend:
    """A backend for ``model``: a URL (or list) gives a remote client, anything else the embedded engine.

    ``model=None`` is the embedded default, the packaged all-MiniLM-L6-v2 bi-encoder.
    Options go to the backend (embedded: device, dtype, mode, template, ...; remote: dialect, api_key, ...).
    ``data_parallel_size`` N (or "auto": every visible GPU) runs N embedded replicas, one process per device;
    one (1, or "auto" with one GPU or on the CPU) keeps the engine in this process.
    """
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if model is not None and not isinstance(model, str) and not is_url(model):
        raise ModelLoadError(f"model must be a folder, a hub id, a server URL or a non-empty list of URLs, "
                             f"not {model!r:.80}")
    if is_url(model):
        from rerankit.remote import RemoteBackend

        return RemoteBackend(model, **options)
    missing = missing_modules("torch", "transformers")
    if missing:
        raise ModelLoadError(
            f"the embedded engine needs {' and '.join(missing)}: pip install 'rerankit[engine]', "
            "or pass a server URL as model"
        )
    check_model_source(model)
    from rerankit.engine import EmbeddedBackend

    if model is None:
        from rerankit.defaults import default_model_path

        model = default_model_path()
    size = options.pop("data_parallel_size", 1)
    if size != 1:  # one engine process per device (engine/replicas.py), where that makes more than one
        from rerankit.engine.replicas import DataParallelBackend, replica_devices

        if len(replica_devices(options.get("device"), size)) > 1:
            return DataParallelBackend(str(model), data_parallel_size=size, **options)
    options.pop("startup_timeout_s", None)  # a replica process's; the engine in process loads before returning
    options.pop("replica_timeout_s", None)  # replicas' too: an engine in this process is not watched
    return EmbeddedBackend(str(model), **options)


class Reranker:
    """Reorders documents by relevance to a query, with a local model or a remote server.

    >>> reranker = Reranker()                                  # packaged MiniLM, on CPU or GPU
    >>> reranker = Reranker("Qwen/Qwen3-Reranker-0.6B", device="cuda")
    >>> reranker = Reranker("http://localhost:8000", dialect="vllm-generative")
    """

    def __init__(self, model: str | Sequence[str] | None = None, *, backend: Backend | None = None,
                 **options: Any) -> None:
        if backend is not None and (model is not None or options):
            given = ["model"] * (model is not None) + sorted(options)
            raise InvalidRequest(given[0], f"{', '.join(given)} would be ignored beside a ready backend: give one "
                                           "or the other")
        self.backend: Backend = backend if backend is not None else make_backend(model, **options)

    def __reduce__(self) -> Any:
        raise TypeError("a Reranker holds a live model or connection pool and cannot be copied or pickled: make one "
                        "in each process (e.g. from the same model name)")

    @property
    def model_name(self) -> str:
        """The model the backend scores with."""
        return self.backend.model_name

    def score(self, request: ScoreRequest) -> ScoreResponse:
        """Score a full request; one result per item, in input order."""
        return self.backend.score(request)

    async def ascore(self, request: ScoreRequest) -> ScoreResponse:
        """Async twin of ``score``."""
        return await self.backend.ascore(request)

    def rank(self, query: str, documents: Iterable[str], top_n: int | None = None,
             **fields: Any) -> list[RankedDocument]:
        """Documents sorted best first (ties by input order), the first ``top_n`` of them; ``documents`` may be any
        iterable of texts (a list, a generator, a pandas Series...)."""
        request = _rank_request(query, documents, top_n, fields)
        return _ranked_documents(self.score(request), request)

    async def arank(self, query: str, documents: Iterable[str], top_n: int | None = None,
                    **fields: Any) -> list[RankedDocument]:
        """Async twin of ``rank``."""
        request = _rank_request(query, documents, top_n, fields)
        return _ranked_documents(await self.ascore(request), request)

    def close(self) -> None:
        """Release the backend's model or connections."""
        self.backend.close()

    def __enter__(self) -> "Reranker":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> "Reranker":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.close)


def _rank_request(query: str, documents: Iterable[str], top_n: int | None, fields: dict[str, Any]) -> ScoreRequest:
    """The request ``rank`` scores: the documents listed once (a single string is left whole, for the schema to
    refuse, rather than split into characters)."""
    items = documents if isinstance(documents, (str, bytes)) else list(documents)
    return ScoreRequest(query=query, items=items, top_n=top_n, **fields)


def _ranked_documents(response: ScoreResponse, request: ScoreRequest) -> list[RankedDocument]:
    """Each ranked result with the text it was scored as (by index into the request's own list)."""
    return [RankedDocument(index=r.index, score=r.score, text=request.items[r.index])
            for r in response.ranked(request.top_n)]
