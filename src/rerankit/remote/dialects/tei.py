"""Hugging Face text-embeddings-inference ``POST /rerank``: ``texts`` in, a list sorted by score out.

rerankit's truncation maps one to one: ``end`` is ``truncate`` to the right, ``start`` to the left,
``none`` is no truncation (TEI then refuses too-long inputs).
"""

from __future__ import annotations

from typing import Any, Literal


from rerankit.remote.dialects.common import (
    Dialect,
    Text,
    Texts,
    WireBody,
    build_request,
    echoed,
    in_input_order,
    param_first,
    parse_wire,
    ranked_results,
    refuse_for_own_head,
    response,
    single_text,
    text_list,
)
from rerankit.schema import ScoreRequest, ScoreResponse

ENDPOINT = "TEI /rerank"
WIRE_NAMES = {"items": "texts", "truncation": "truncation_direction"}  # the body's names of ScoreRequest fields
_DIRECTIONS = {"end": "Right", "start": "Left"}
# TEI's error_type per HTTP status.
_ERROR_TYPES = {400: "Validation", 413: "Validation", 422: "Validation", 424: "Backend", 429: "Overloaded",
                503: "Unhealthy"}


class RerankBody(WireBody):
    """``POST /rerank``."""

    query: Text
    texts: Texts
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None
    truncation_direction: Literal["Right", "Left"] = "Right"


def encode_request(request: ScoreRequest, model: str | None) -> tuple[str, dict[str, Any]]:
    """``/rerank`` body with activated scores (raw ones for ``raw_scores``) and rerankit's truncation; TEI serves
    one model."""
    refuse_for_own_head(request, ENDPOINT, mode=(None, "cross-encoder"), instruction=(None,),
                        max_tokens_per_item=(None,), raw_scores=(False, True))
    body: dict[str, Any] = {"query": request.query, "texts": list(request.items), "raw_scores": request.raw_scores,
                            "return_text": False, "truncate": request.truncation != "none"}
    if request.truncation != "none":
        body["truncation_direction"] = _DIRECTIONS[request.truncation]
    return "/rerank", body


def decode_response(body: Any, request: ScoreRequest, model: str | None = None) -> ScoreResponse:
    """A JSON list of ``{"index", "score"}`` sorted by score, put back in input order (no token counts)."""
    return response(in_input_order(body, "score", len(request.items), ENDPOINT), None, model, 0)


def parse_request(body: Any) -> ScoreRequest:
    """A ``/rerank`` body as a ``ScoreRequest``; ``raw_scores`` asks for the logits (``ScoreRequest.raw_scores``)."""
    wire = parse_wire(RerankBody, body)
    truncation = "none" if wire.truncate is False else "end" if wire.truncation_direction == "Right" else "start"
    return build_request(WIRE_NAMES, query=single_text(wire.query, "query"),
                         items=text_list(wire.texts, "texts"), truncation=truncation,
                         raw_scores=wire.raw_scores)


def encode_response(response_: ScoreResponse, request: ScoreRequest, model: str | None = None,
                    documents: list[Any] | None = None) -> list[dict[str, Any]]:
    """A list best first; ``text`` when ``return_text`` was asked."""
    return ranked_results(response_, request, "score", "text", documents)


def echoed_documents(body: Any) -> list[Any] | None:
    """The texts when ``return_text`` (false unless asked)."""
    return echoed(body, "texts", isinstance(body, dict) and body.get("return_text") is True)


def error_body(status: int, message: str, param: str | None = None, kind: str | None = None) -> dict[str, Any]:
    """TEI's ``{"error": message, "error_type": "Validation" | "Overloaded" | ...}``."""
    return {"error": param_first(message, param), "error_type": kind or _ERROR_TYPES.get(status, "Backend")}


TEI = Dialect(
    name="tei", paths=("/rerank",), max_items=32,
    encode_request=encode_request, decode_response=decode_response, parse_request=parse_request,
    encode_response=encode_response, error_body=error_body, request_body=RerankBody,
    echoed_documents=echoed_documents, wire_names=WIRE_NAMES,
    markers=(frozenset({"texts"}), frozenset({"return_text"}), frozenset({"truncate"}),
             frozenset({"truncation_direction"})))
