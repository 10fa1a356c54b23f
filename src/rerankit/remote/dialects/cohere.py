"""Cohere-style rerank: Cohere's ``/v2/rerank`` and ``/v1/rerank`` (its v1 API; Jina's, which takes a subset of
this body, answers in its own shape: ``jina.py``).

Results come sorted by ``relevance_score``; the client puts them back in input order by ``index``. Cohere v1
takes documents as objects too: ``rank_fields`` names the fields scored, which are joined as ``field: value``
lines (the YAML-like form Cohere recommends for structured documents); without it an object's ``text`` is scored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import Field, WithJsonSchema

from rerankit.errors import InvalidRequest
from rerankit.remote.dialects.common import (
    Dialect,
    Text,
    WireBody,
    any_priority,
    build_request,
    echoed,
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
    with_priority,
)
from rerankit.schema import ScoreRequest, ScoreResponse

ENDPOINT = "Cohere-style /rerank"
# meta.api_version of Cohere's replies by API version (its API reference's examples of /v2/rerank and /v1/rerank;
# the SDK reads ``version`` as a string)
API_VERSIONS: dict[str, dict[str, Any]] = {"2": {"version": "2", "is_experimental": False}, "1": {"version": "1"}}
# meta.billed_units.search_units: a number in Cohere's OpenAPI spec, whose rerank examples answer 1 for a few
# documents. Cohere's pricing rule, as Microsoft's Azure AI Foundry page on Cohere Rerank v3.5 states it: "Cohere
# counts a single search unit as a query with up to 100 documents to be ranked. Documents longer than 500 tokens
# when including the length of the search query are split up into multiple chunks, where each chunk counts as a
# single document." (That page gives 4096 tokens for Rerank v3; docs/wire.md#cohere-search-units.)
SEARCH_UNIT_DOCUMENTS = 100
SEARCH_UNIT_CHUNK_TOKENS = 500
# Read by document_texts (whose errors name the document), typed for the OpenAPI schema.
_OBJECT_DOCUMENT = {"type": "object", "required": ["text"], "additionalProperties": {"type": "string"}}
Documents = Annotated[Any, WithJsonSchema(
    {"type": "array", "minItems": 1, "items": {"anyOf": [{"type": "string"}, _OBJECT_DOCUMENT]}})]


class RerankBody(WireBody):
    """``POST /v2/rerank`` and ``/v1/rerank`` (Cohere v1, Jina)."""

    model: str | None = None
    query: Text
    documents: Documents
    top_n: int | None = Field(default=None, ge=1)
    max_tokens_per_doc: int | None = Field(default=None, ge=1)
    return_documents: bool | None = None
    rank_fields: list[str] | None = Field(default=None, min_length=1)
    max_chunks_per_doc: int | None = Field(default=None, ge=1)
    priority: int | None = None


def encode_request(request: ScoreRequest, model: str | None) -> tuple[str, dict[str, Any]]:
    """Rerank body with ``model`` (Cohere requires it) and ``max_tokens_per_doc``; no ``top_n``."""
    refuse_for_own_head(request, ENDPOINT, mode=(None, "cross-encoder"), instruction=(None,),
                        truncation=("end", "none"), **any_priority(request))
    body: dict[str, Any] = with_priority({"query": request.query, "documents": list(request.items)}, request)
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
    """A rerank body as a ``ScoreRequest``; ``max_tokens_per_doc`` cuts each document's end.

    ``max_chunks_per_doc`` (Cohere v1: score a long document's chunks, keep the best) scores a document longer than
    the model takes in at most that many windows and keeps the best (``long_documents="max"``). ``priority`` orders
    rerankit serve's queue (lower first).
    """
    wire = parse_wire(RerankBody, body)
    chunks = {} if wire.max_chunks_per_doc is None else {
        "long_documents": "max", "long_document_max_windows": wire.max_chunks_per_doc}
    return build_request({"items": "documents", "max_tokens_per_item": "max_tokens_per_doc",
                          "long_document_max_windows": "max_chunks_per_doc"},
                         query=single_text(wire.query, "query"), items=document_texts(wire.documents,
                                                                                      wire.rank_fields),
                         top_n=wire.top_n, max_tokens_per_item=wire.max_tokens_per_doc, priority=wire.priority or 0,
                         **chunks)


def document_texts(documents: Any, rank_fields: list[str] | None) -> list[str]:
    """The text scored for each document: a string as is; an object's ``rank_fields`` as ``field: value`` lines,
    in the order given (fields a document lacks are skipped), or its ``text`` when no ``rank_fields``."""
    if isinstance(documents, str) or not isinstance(documents, list) or \
            all(isinstance(document, str) for document in documents):
        return text_list(documents, "documents")
    texts = []
    for index, document in enumerate(documents):
        if isinstance(document, str):
            texts.append(document)
            continue
        if not isinstance(document, dict):
            raise InvalidRequest(f"documents.{index}", "must be a text or an object of fields")
        if rank_fields is None:
            if not isinstance(document.get("text"), str):
                raise InvalidRequest(f"documents.{index}", "an object document needs a text field "
                                                           "(or give rank_fields)")
            texts.append(document["text"])
            continue
        lines = [f"{field}: {_field_text(document[field])}" for field in rank_fields if field in document]
        if not lines:
            raise InvalidRequest(f"documents.{index}", f"has none of the rank_fields {rank_fields}")
        texts.append("\n".join(lines))
    return texts


def _field_text(value: Any) -> str:
    """A field's value as text: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def search_units(chunks: int, prompt_tokens: int = 0) -> int:
    """Cohere's search units for ``chunks`` sequences scored (one per document, or each window of one scored in
    windows) holding ``prompt_tokens`` in all (query, document and the model's special tokens, as the served model
    read them): one unit per 100 billed documents begun, a sequence counting as one per 500 of its tokens begun.
    Only the total is known, not each sequence's length, so the billed documents are the larger of two lower
    bounds, ``chunks`` and ``ceil(prompt_tokens / 500)``: exact where no sequence is longer than 500 tokens, never
    more than Cohere's rule gives for the same sequences. 0 documents: 0 units (Cohere refuses such a request)."""
    billed = max(chunks, -(-prompt_tokens // SEARCH_UNIT_CHUNK_TOKENS))
    return -(-billed // SEARCH_UNIT_DOCUMENTS)


def encode_response(response_: ScoreResponse, request: ScoreRequest, model: str | None = None,
                    documents: list[Any] | None = None, api_version: str = "2") -> dict[str, Any]:
    """Cohere body: results best first, cut to ``top_n``; input tokens in ``meta.tokens``; ``meta.api_version``
    as Cohere's ``/v2/rerank`` answers it; ``meta.billed_units.search_units`` by ``search_units``."""
    results = ranked_results(response_, request, "relevance_score", "document.text", documents)
    units = search_units(sum(result.windows for result in response_.results), response_.usage.prompt_tokens)
    meta = {"api_version": dict(API_VERSIONS[api_version]), "billed_units": {"search_units": units},
            "tokens": {"input_tokens": response_.usage.prompt_tokens, "output_tokens": 0}}
    return {"id": new_id("rerank"), "results": results, "meta": meta}


def encode_v1_response(response_: ScoreResponse, request: ScoreRequest, model: str | None = None,
                       documents: list[Any] | None = None) -> dict[str, Any]:
    """``encode_response`` as Cohere's ``/v1/rerank`` answers: ``meta.api_version`` ``{"version": "1"}``."""
    return encode_response(response_, request, model, documents, api_version="1")


def echoed_documents(body: Any) -> list[Any] | None:
    """With ``return_documents`` (Cohere v1, Jina; false unless asked) the documents as sent, objects whole."""
    return echoed(body, "documents", isinstance(body, dict) and body.get("return_documents") is True)


def error_body(status: int, message: str, param: str | None = None, kind: str | None = None) -> dict[str, Any]:
    """Cohere's ``{"message": ...}`` (the field, when known, leads the message)."""
    return {"message": param_first(message, param)}


COHERE = Dialect(
    name="cohere", paths=("/v2/rerank", "/v1/rerank"), max_items=1000,
    encode_request=encode_request, decode_response=decode_response, parse_request=parse_request,
    encode_response=encode_response, error_body=error_body, request_body=RerankBody,
    echoed_documents=echoed_documents, requires_model=True, path_variants={"/v1/rerank": {
        "encode_response": encode_v1_response}},
    wire_names={"items": "documents", "max_tokens_per_item": "max_tokens_per_doc",
                "long_documents": "max_chunks_per_doc", "long_document_max_windows": "max_chunks_per_doc"},
    # Fields only Cohere v1 has; its SDKs say who they are (routes.SDK_HEADERS). Without either, model with
    # return_documents is what Jina's clients send (jina.py), and a Cohere v1 client not using an SDK too.
    markers=(frozenset({"rank_fields"}), frozenset({"max_chunks_per_doc"})))
