"""Voyage AI's rerank API, ``POST /v1/rerank``: what the ``voyageai`` SDK's ``Client.rerank`` (and LangChain's
``VoyageAIRerank`` on it) sends to ``base_url``.

Request: ``query``, ``documents`` (texts), ``model``, ``top_k`` (sent as null when not set), ``truncation`` (true,
the default: a document that is too long is cut; false: refused), ``return_documents``. Reply: ``{"object": "list",
"data": [{"relevance_score", "index", "document"?}], "model", "usage": {"total_tokens"}}``, best first.
``/v1/rerank`` is shared with vLLM, SGLang, Cohere and Infinity: ``top_k`` and ``truncation`` are Voyage's alone.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rerankit.remote.dialects.common import (
    Dialect,
    Text,
    Texts,
    WireBody,
    build_request,
    echoed,
    in_input_order,
    detail_error,
    parse_wire,
    ranked_results,
    refuse_for_own_head,
    response,
    single_text,
    text_list,
    with_model,
)
from rerankit.schema import ScoreRequest, ScoreResponse

ENDPOINT = "Voyage /v1/rerank"
WIRE_NAMES = {"items": "documents", "top_n": "top_k"}  # the body's names of ScoreRequest fields


class RerankBody(WireBody):
    """``POST /v1/rerank`` of Voyage AI."""

    query: Text
    documents: Texts
    model: str | None = None
    top_k: int | None = Field(default=None, ge=1)
    truncation: bool = True
    return_documents: bool = False


def encode_request(request: ScoreRequest, model: str | None) -> tuple[str, dict[str, Any]]:
    """``/v1/rerank`` body without ``top_k`` (every document comes back); Voyage cuts a document's end or, with
    ``truncation: false``, refuses it."""
    refuse_for_own_head(request, ENDPOINT, mode=(None, "cross-encoder"), instruction=(None,),
                        max_tokens_per_item=(None,), truncation=("end", "none"))
    body = {"query": request.query, "documents": list(request.items), "truncation": request.truncation == "end"}
    return "/v1/rerank", with_model(body, model)


def decode_response(body: Any, request: ScoreRequest, model: str | None = None) -> ScoreResponse:
    """``{"data": [{"index", "relevance_score"}], "usage": {"total_tokens"}}`` best first, in input order."""
    results = in_input_order(body["data"], "relevance_score", len(request.items), ENDPOINT)
    usage = body.get("usage")
    return response(results, body, model, int(usage.get("total_tokens") or 0) if isinstance(usage, dict) else 0)


def parse_request(body: Any) -> ScoreRequest:
    """A Voyage ``/v1/rerank`` body as a ``ScoreRequest``."""
    wire = parse_wire(RerankBody, body)
    return build_request(WIRE_NAMES, query=single_text(wire.query, "query"),
                         items=text_list(wire.documents, "documents"), top_n=wire.top_k,
                         truncation="end" if wire.truncation else "none")


def encode_response(response_: ScoreResponse, request: ScoreRequest, model: str | None = None,
                    documents: list[Any] | None = None) -> dict[str, Any]:
    """Voyage's list object, best first, cut to ``top_k``; ``document`` when ``return_documents`` was asked."""
    return {"object": "list", "data": ranked_results(response_, request, "relevance_score", "document", documents),
            "model": model or response_.model, "usage": {"total_tokens": response_.usage.prompt_tokens}}


def echoed_documents(body: Any) -> list[Any] | None:
    """The documents when ``return_documents`` (false unless asked)."""
    return echoed(body, "documents", isinstance(body, dict) and body.get("return_documents") is True)


VOYAGE = Dialect(
    name="voyage", paths=("/v1/rerank",), max_items=1000,
    encode_request=encode_request, decode_response=decode_response, parse_request=parse_request,
    encode_response=encode_response, error_body=detail_error, request_body=RerankBody,
    echoed_documents=echoed_documents, wire_names=WIRE_NAMES,
    markers=(frozenset({"top_k"}), frozenset({"truncation"})))
