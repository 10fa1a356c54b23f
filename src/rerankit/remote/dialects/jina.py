"""Jina AI's ``/v1/rerank``: ``model``, ``query``, ``documents``, ``top_n`` and ``return_documents`` in (a subset of
Cohere's v1 body, read with its model), ``{"model", "usage": {"total_tokens"}, "results"}`` out, results sorted by
``relevance_score``, each document echoed as ``{"text": ...}`` when asked; errors as ``{"detail": ...}``.

Jina's body is also what a Cohere v1 client sends without the SDK's header (LiteLLM's ``azure_ai`` and
``litellm_proxy`` providers), and nothing in it tells the two apart. So the reply is Cohere v1's (``id``,
``meta.billed_units``) with Jina's ``model`` and ``usage`` added: each client reads its own fields (LiteLLM's
``jina_ai`` provider bills ``usage.total_tokens``, its Cohere ones ``meta.billed_units``), and neither loses any.
"""

from __future__ import annotations

from typing import Any

from rerankit.remote.dialects.cohere import COHERE, RerankBody, echoed_documents, encode_v1_response, parse_request
from rerankit.remote.dialects.common import (
    Dialect,
    in_input_order,
    detail_error,
    prompt_tokens_of,
    refuse_for_own_head,
    response,
    with_model,
)
from rerankit.schema import ScoreRequest, ScoreResponse

ENDPOINT = "Jina /v1/rerank"


def encode_request(request: ScoreRequest, model: str | None) -> tuple[str, dict[str, Any]]:
    """``/v1/rerank`` body with ``model`` (Jina requires it); no ``top_n``, no documents echoed back. Jina cuts long
    documents itself and takes no per-document cap (``truncation="none"`` is sent as Cohere's is)."""
    refuse_for_own_head(request, ENDPOINT, mode=(None, "cross-encoder"), instruction=(None,),
                        max_tokens_per_item=(None,), truncation=("end", "none"))
    body = {"query": request.query, "documents": list(request.items), "return_documents": False}
    return "/v1/rerank", with_model(body, model)


def decode_response(body: Any, request: ScoreRequest, model: str | None = None) -> ScoreResponse:
    """``{"results": [{"index", "relevance_score"}], "usage": {"total_tokens"}}``, put back in input order."""
    results = in_input_order(body["results"], "relevance_score", len(request.items), ENDPOINT)
    return response(results, body, model, prompt_tokens_of(body.get("usage")))


def encode_response(response_: ScoreResponse, request: ScoreRequest, model: str | None = None,
                    documents: list[Any] | None = None) -> dict[str, Any]:
    """Jina's reply (the model, the tokens read as ``usage.total_tokens``, results best first cut to ``top_n``)
    within Cohere v1's (``id``, ``meta``), whose client may have sent the same body."""
    reply = encode_v1_response(response_, request, model, documents)
    return {"id": reply["id"], "model": model or response_.model,
            "usage": {"total_tokens": response_.usage.prompt_tokens}, "results": reply["results"],
            "meta": reply["meta"]}


JINA = Dialect(
    name="jina", paths=("/v1/rerank",), max_items=1000,
    encode_request=encode_request, decode_response=decode_response, parse_request=parse_request,
    encode_response=encode_response, error_body=detail_error, request_body=RerankBody,
    echoed_documents=echoed_documents, requires_model=True,
    wire_names=COHERE.wire_names,
    # What Jina's clients send (LiteLLM's jina_ai, LangChain's JinaRerank): model with return_documents. Cohere's v1
    # API takes the same body, which the Cohere SDKs mark with their header; a body that also holds a field of
    # Cohere's alone (rank_fields, max_chunks_per_doc) is Cohere's, and a tie between the two goes to Cohere.
    markers=(frozenset({"model", "return_documents"}),))
