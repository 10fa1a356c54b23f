"""Cohere-style rerank: Cohere's ``/v2/rerank``, and ``/v1/rerank`` of Jina and Infinity.

Results come sorted by ``relevance_score``; the client puts them back in input order by ``index``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rerankit.errors import InvalidRequest
from rerankit.remote.dialects.common import (
    Dialect,
    WireBody,
    build_request,
    in_input_order,
    new_id,
    param_first,
    parse_wire,
    prompt_tokens_of,
    ranked_results,
    refuse_for_own_head,
    response,
    single_text,
    text_list,
    with_model,
)
from rerankit.schema import ScoreRequest, ScoreResponse

ENDPOINT = "Cohere-style /rerank"


class RerankBody(WireBody):
    """``POST /v2/rerank`` (and Jina/Infinity ``/v1/rerank``)."""

    model: str | None = None
    query: Any
    documents: Any
    top_n: int | None = Field(default=None, ge=1)
    max_tokens_per_doc: int | None = Field(default=None, ge=1)
    return_documents: bool = False


def encode_request(request: ScoreRequest, model: str | None) -> tuple[str, dict[str, Any]]:
    """Rerank body with ``model`` (Cohere requires it) and ``max_tokens_per_doc``; no ``top_n``."""
    refuse_for_own_head(request, ENDPOINT, mode=(None, "cross-encoder"), instruction=(None,),
                        truncation=("end", "none"))
    body: dict[str, Any] = {"query": request.query, "documents": list(request.items)}
    if request.max_tokens_per_item is not None:
        if request.truncation == "none":
            raise InvalidRequest("max_tokens_per_item", f"{ENDPOINT} cuts documents to max_tokens_per_doc; "
                                                        "it cannot refuse them under truncation='none'")
        body["max_tokens_per_doc"] = request.max_tokens_per_item
    return "/v2/rerank", with_model(body, model)


def decode_response(body: Any, request: ScoreRequest, model: str | None = None) -> ScoreResponse:
    """``{"results": [{"index", "relevance_score"}]}``; tokens from Jina/Infinity ``usage`` or Cohere ``meta``."""
    results = in_input_order(body["results"], "relevance_score", len(request.items), ENDPOINT)
    tokens = prompt_tokens_of(body.get("usage"))
    meta_tokens = (body.get("meta") or {}).get("tokens")
    if not tokens and isinstance(meta_tokens, dict):
        tokens = int(meta_tokens.get("input_tokens") or 0)
    return response(results, body, model, tokens)


def parse_request(body: Any) -> ScoreRequest:
    """A rerank body as a ``ScoreRequest``; ``max_tokens_per_doc`` cuts each document's end."""
    wire = parse_wire(RerankBody, body)
    return build_request({"items": "documents", "max_tokens_per_item": "max_tokens_per_doc"},
                         query=single_text(wire.query, "query"), items=text_list(wire.documents, "documents"),
                         top_n=wire.top_n, max_tokens_per_item=wire.max_tokens_per_doc)


def encode_response(response_: ScoreResponse, request: ScoreRequest, model: str | None = None,
                    return_documents: bool = False) -> dict[str, Any]:
    """Cohere v2 body: results best first, cut to ``top_n``; input tokens in ``meta.tokens``."""
    results = ranked_results(response_, request, "relevance_score", "document.text", return_documents)
    meta = {"api_version": {"version": "2"},
            "tokens": {"input_tokens": response_.usage.prompt_tokens, "output_tokens": 0}}
    return {"id": new_id("rerank"), "results": results, "meta": meta}


def documents_requested(body: Any) -> bool:
    """``return_documents`` (Jina/Infinity); Cohere v2 does not echo documents."""
    return isinstance(body, dict) and body.get("return_documents") is True


def error_body(status: int, message: str, param: str | None = None, kind: str | None = None) -> dict[str, Any]:
    """Cohere's ``{"message": ...}`` (the field, when known, leads the message)."""
    return {"message": param_first(message, param)}


COHERE = Dialect(
    name="cohere", paths=("/v2/rerank", "/v1/rerank"), max_items=1000,
    encode_request=encode_request, decode_response=decode_response, parse_request=parse_request,
    encode_response=encode_response, error_body=error_body, request_body=RerankBody,
    documents_requested=documents_requested)
