"""NVIDIA NIM's reranking API, ``POST /v1/ranking``: what ``langchain-nvidia-ai-endpoints``' ``NVIDIARerank`` and
LlamaIndex's ``NVIDIARerank`` send to a NIM at ``base_url`` (they also list ``{base_url}/models``).

Request: ``model``, ``query: {"text"}``, ``passages: [{"text"}]``, ``truncate``: ``"END"`` cuts a passage that
is too long, ``"NONE"`` (NIM's default) refuses it. Reply: ``{"rankings": [{"index", "logit"}]}`` for every passage,
best first. The logit is the score before its activation, so the server scores with ``raw_scores`` and the client
applies the sigmoid (a NIM reranker is a one-logit cross-encoder) unless the request asked for raw scores.
"""

from __future__ import annotations

from typing import Any, Literal

from rerankit.errors import InvalidRequest
from rerankit.remote.dialects.common import (
    Dialect,
    WireBody,
    build_request,
    in_input_order,
    openai_error,
    parse_wire,
    ranked_results,
    refuse_for_own_head,
    response,
    sigmoid,
    single_text,
    with_model,
)
from rerankit.schema import ScoreRequest, ScoreResponse, ScoreResult

ENDPOINT = "NIM /v1/ranking"
WIRE_NAMES = {"items": "passages", "truncation": "truncate"}  # the body's names of ScoreRequest fields
_TRUNCATE = {"end": "END", "none": "NONE"}


class RankingBody(WireBody):
    """``POST /v1/ranking``."""

    model: str | None = None
    query: Any
    passages: list[Any]
    truncate: Literal["NONE", "END"] = "NONE"


def encode_request(request: ScoreRequest, model: str | None) -> tuple[str, dict[str, Any]]:
    """``/v1/ranking`` body; a NIM cuts a passage's end or refuses it (no start, no per-passage cap)."""
    refuse_for_own_head(request, ENDPOINT, mode=(None, "cross-encoder"), instruction=(None,),
                        max_tokens_per_item=(None,), truncation=("end", "none"), raw_scores=(False, True))
    body = {"query": {"text": request.query}, "passages": [{"text": item} for item in request.items],
            "truncate": _TRUNCATE[request.truncation]}
    return "/v1/ranking", with_model(body, model)


def decode_response(body: Any, request: ScoreRequest, model: str | None = None) -> ScoreResponse:
    """``{"rankings": [{"index", "logit"}]}`` best first, put back in input order: the logits as they are for
    ``raw_scores``, else their sigmoid (no token counts)."""
    results = in_input_order(body["rankings"], "logit", len(request.items), ENDPOINT)
    if not request.raw_scores:
        results = [ScoreResult(index=result.index, score=sigmoid(result.score)) for result in results]
    return response(results, body, model, 0)


def _text_of(value: Any, field: str) -> str:
    """A NIM text object ``{"text": ...}`` (a bare string is taken too); images are not scored."""
    if isinstance(value, dict):
        if value.get("image") is not None:
            raise InvalidRequest(f"{field}.image", "images are not scored: give text passages")
        value = value.get("text")
    return single_text(value, f"{field}.text" if not isinstance(value, str) else field)


def parse_request(body: Any) -> ScoreRequest:
    """A ``/v1/ranking`` body as a ``ScoreRequest`` scoring raw logits (what the reply carries)."""
    wire = parse_wire(RankingBody, body)
    if not wire.passages:
        raise InvalidRequest("passages", "must hold at least one passage")
    passages = [_text_of(passage, f"passages[{index}]") for index, passage in enumerate(wire.passages)]
    return build_request(WIRE_NAMES, query=_text_of(wire.query, "query"), items=passages,
                         truncation="end" if wire.truncate == "END" else "none", raw_scores=True)


def encode_response(response_: ScoreResponse, request: ScoreRequest, model: str | None = None,
                    documents: list[Any] | None = None) -> dict[str, Any]:
    """``{"rankings": [{"index", "logit"}]}``, every passage, best first."""
    return {"rankings": ranked_results(response_, request, "logit", "", None)}


def error_body(status: int, message: str, param: str | None = None, kind: str | None = None) -> dict[str, Any]:
    """rerankit's own error body (NIM documents none of its own)."""
    return {"error": openai_error(status, message, param, kind)}


NIM = Dialect(
    name="nim", paths=("/v1/ranking", "/ranking"), max_items=64,
    encode_request=encode_request, decode_response=decode_response, parse_request=parse_request,
    encode_response=encode_response, error_body=error_body, request_body=RankingBody,
    wire_names=WIRE_NAMES)
