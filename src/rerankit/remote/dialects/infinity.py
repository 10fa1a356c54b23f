"""Infinity's ``/rerank`` (also ``/v1/rerank``): ``documents`` in, ``results`` sorted by ``relevance_score`` out,
each document echoed as a plain string when ``return_documents``; what the ``infinity_client`` package sends.

``raw_scores: false`` (its default) asks for activated scores (a cross-encoder's sigmoid), ``true`` for the logits
(``ScoreRequest.raw_scores``).
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
    new_id,
    now,
    parse_wire,
    prompt_tokens_of,
    ranked_results,
    refuse_for_own_head,
    response,
    single_text,
    text_list,
    with_model,
)
from rerankit.remote.dialects.vllm import error_body  # Infinity answers errors in the same OpenAI shape
from rerankit.schema import ScoreRequest, ScoreResponse

WIRE_NAMES = {"items": "documents"}  # the body's names of ScoreRequest fields, for errors that name them
ENDPOINT = "Infinity /rerank"


class RerankBody(WireBody):
    """``POST /rerank`` of Infinity (``infinity_client``'s ``RerankInput``)."""

    model: str | None = None
    query: Text
    documents: Texts
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False
    raw_scores: bool = False


def encode_request(request: ScoreRequest, model: str | None) -> tuple[str, dict[str, Any]]:
    """``/rerank`` body asking for activated scores; Infinity cuts long documents itself (no per-document cap).

    ``truncation="none"`` is sent as the other values are (as Cohere's is): Infinity has no way to refuse a long
    document, and vLLM's bodies, which leave the cut out, say "none" (vLLM refuses a prompt over its limit); refusing
    it would refuse every such body a proxy in front of Infinity (``rerankit serve --model``) passes on.
    """
    refuse_for_own_head(request, ENDPOINT, mode=(None, "cross-encoder"), instruction=(None,),
                        max_tokens_per_item=(None,), truncation=("end", "none"), raw_scores=(False, True))
    body = {"query": request.query, "documents": list(request.items), "return_documents": False,
            "raw_scores": request.raw_scores}
    return "/rerank", with_model(body, model)


def decode_response(body: Any, request: ScoreRequest, model: str | None = None) -> ScoreResponse:
    """``{"results": [{"index", "relevance_score"}], "usage"}`` sorted by score, put back in input order."""
    results = in_input_order(body["results"], "relevance_score", len(request.items), ENDPOINT)
    return response(results, body, model, prompt_tokens_of(body.get("usage")))


def parse_request(body: Any) -> ScoreRequest:
    """A ``/rerank`` body as a ``ScoreRequest``."""
    wire = parse_wire(RerankBody, body)
    return build_request(WIRE_NAMES, query=single_text(wire.query, "query"),
                         items=text_list(wire.documents, "documents"), top_n=wire.top_n, raw_scores=wire.raw_scores)


def encode_response(response_: ScoreResponse, request: ScoreRequest, model: str | None = None,
                    documents: list[Any] | None = None) -> dict[str, Any]:
    """Infinity's ``ReRankResult``: results best first, cut to ``top_n``, documents as strings when asked."""
    results = ranked_results(response_, request, "relevance_score", "document", documents)
    tokens = response_.usage.prompt_tokens
    return {"object": "rerank", "results": results, "model": model or response_.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "id": new_id("infinity"),
            "created": now()}


def echoed_documents(body: Any) -> list[Any] | None:
    """The documents when ``return_documents`` (false unless asked)."""
    return echoed(body, "documents", isinstance(body, dict) and body.get("return_documents") is True)


INFINITY = Dialect(
    name="infinity", paths=("/rerank", "/v1/rerank"), max_items=256,
    encode_request=encode_request, decode_response=decode_response, parse_request=parse_request,
    encode_response=encode_response, error_body=error_body, request_body=RerankBody,
    echoed_documents=echoed_documents, wire_names=WIRE_NAMES,
    # infinity_client sends raw_scores, return_documents and model in every body: all three are its claim. On
    # /rerank, return_documents alone is Infinity's too (vLLM's and TEI's rerank bodies have no such field): LiteLLM's
    # infinity provider sends model, query, documents, top_n and return_documents, and reads the document a string.
    markers=(frozenset({"raw_scores"}), frozenset({"raw_scores", "return_documents", "model"}),
             frozenset({"return_documents"})))
