"""The wire dialects rerankit speaks, by name: the one place that knows each server's format.

Each ``Dialect`` goes both ways, as pure functions: ``encode_request``/``decode`` for the client,
``parse_request``/``encode_response``/``error_body`` for the server routes.
"""

from __future__ import annotations

from rerankit.errors import InvalidRequest
from rerankit.remote.dialects.cohere import COHERE
from rerankit.remote.dialects.common import Dialect, read_error
from rerankit.remote.dialects.infinity import INFINITY
from rerankit.remote.dialects.jina import JINA
from rerankit.remote.dialects.nim import NIM
from rerankit.remote.dialects.sglang import SGLANG_RERANK, SGLANG_SCORE
from rerankit.remote.dialects.tei import TEI
from rerankit.remote.dialects.vllm import VLLM_GENERATIVE, VLLM_RERANK, VLLM_SCORE
from rerankit.remote.dialects.voyage import VOYAGE

DIALECTS: dict[str, Dialect] = {
    dialect.name: dialect
    for dialect in (VLLM_GENERATIVE, VLLM_SCORE, VLLM_RERANK, SGLANG_SCORE, SGLANG_RERANK, COHERE, JINA, TEI,
                    INFINITY, NIM, VOYAGE)
}


def get_dialect(name: str) -> Dialect:
    """The dialect called ``name``; ``InvalidRequest`` naming the known ones otherwise."""
    try:
        return DIALECTS[name]
    except KeyError:
        raise InvalidRequest("dialect", f"unknown dialect {name!r}; known: {', '.join(DIALECTS)}") from None


__all__ = ["DIALECTS", "Dialect", "get_dialect", "read_error"]
