"""SGLang's scoring routes: ``/v1/score`` (label probabilities of a CausalLM, or a classifier's class scores)
and ``/v1/rerank`` (a JSON list sorted by score).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Union

from pydantic import Field, WithJsonSchema

from rerankit.errors import InvalidRequest, RemoteError
from rerankit.remote.dialects.common import (
    ITEMS_SCHEMA,
    NULL_ONLY,
    NULL_SCHEMA,
    TEXT_SCHEMA,
    TOKEN_IDS_SCHEMA,
    Dialect,
    Text,
    TextOrTokens,
    Texts,
    WireBody,
    build_request,
    echoed,
    in_input_order,
    openai_error,
    openai_usage,
    parse_wire,
    probability_logs,
    prompt_tokens_of,
    ranked_results,
    raw_prompt_parts,
    refuse,
    refuse_for_own_head,
    response,
    scored,
    sigmoid,
    single_text,
    text_list,
    wire_refuse,
    wire_refuse_set,
    with_model,
)
from rerankit.schema import ScoreRequest, ScoreResponse, ScoreResult
from rerankit.templates import RAW

SCORE = "SGLang /v1/score"
# The largest logit answered: sigmoid(100) is 1.0 in float64, so a saturated score still round-trips.
LOGIT_LIMIT = 100.0
RERANK = "SGLang /v1/rerank"
RERANK_WIRE_NAMES = {"items": "documents", "instruction": "instruct"}  # /v1/rerank's names of ScoreRequest fields
# The label ids are what make a body generative (mode, raw template) and ask for every label's probability.
LABELLED = {"mode": "label_token_ids", "template": "label_token_ids", "return_label_logprobs": "label_token_ids"}


class ScoreBody(WireBody):
    """``POST /v1/score``."""

    model: str | None = None
    query: TextOrTokens
    items: Annotated[Union[str, list[str], list[list[int]]], WithJsonSchema({"anyOf": [TEXT_SCHEMA, ITEMS_SCHEMA]})]
    label_token_ids: Annotated[Union[list[int], list[list[int]], None], WithJsonSchema(
        {"anyOf": [TOKEN_IDS_SCHEMA, NULL_SCHEMA]})] = None
    apply_softmax: bool = False
    temperature: Annotated[float, WithJsonSchema({"const": 1.0})] = Field(default=1.0, gt=0)
    return_token_logprobs: Annotated[bool, WithJsonSchema({"const": False})] = False
    item_first: bool = False
    return_pooled_hidden_states: bool = False
    score_extraction_token: Annotated[str | None, NULL_ONLY] = None
    embed_override_token_id: Annotated[int | None, NULL_ONLY] = None
    query_embed_overrides: Annotated[Any, NULL_ONLY] = None
    item_embed_overrides: Annotated[Any, NULL_ONLY] = None


class RerankBody(WireBody):
    """``POST /v1/rerank``."""

    query: Text
    documents: Texts
    instruct: str | None = None
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True


# Client side ------------------------------------------------------------------------------------------

def encode_score_request(request: ScoreRequest, model: str | None) -> tuple[str, dict[str, Any]]:
    """``/v1/score`` body: label ids for a CausalLM, none for a classifier; ``apply_softmax`` always sent,
    since SGLang's default (false) differs from rerankit's.

    A classifier is sent ``apply_softmax: false``: SGLang then answers the head's logits, and the client
    activates them as rerankit does (sigmoid of a lone logit, softmax's class 1 of several), whereas a softmax
    over a lone logit is 1.0 for every item.
    """
    refuse(request, SCORE, mode=(None, "generative", "cross-encoder"), labels=(None,), add_special_tokens=(True,),
           max_tokens_per_item=(None,), truncation=("end", "none"), mis_delimiter_token_id=(None,))
    if request.label_token_ids is None:
        if request.mode == "generative":
            raise InvalidRequest("label_token_ids", f"{SCORE} needs label_token_ids to score a CausalLM")
        if request.return_label_logprobs:
            raise InvalidRequest("return_label_logprobs", f"{SCORE} gives label log-probs for label_token_ids")
        refuse(request, f"{SCORE} without label_token_ids", apply_softmax=(True,))
    elif request.mode == "cross-encoder":
        raise InvalidRequest("label_token_ids", f"{SCORE} scores a classifier with its own head, not label ids")
    query, items, instruction = raw_prompt_parts(request, SCORE)
    if instruction is not None:
        raise InvalidRequest("instruction", f"{SCORE} has no instruction; use a template that takes one")
    classifier = request.label_token_ids is None
    body: dict[str, Any] = {"query": query, "items": items,
                            "apply_softmax": request.apply_softmax and not classifier, "item_first": request.item_first}
    if not classifier:
        body["label_token_ids"] = request.label_token_ids
    if request.return_pooled_hidden_states:
        body["return_pooled_hidden_states"] = True
    return "/v1/score", with_model(body, model)


def encode_rerank_request(request: ScoreRequest, model: str | None) -> tuple[str, dict[str, Any]]:
    """``/v1/rerank`` body; the instruction travels as ``instruct``, documents are not echoed back."""
    refuse_for_own_head(request, RERANK, mode=(None, "generative", "cross-encoder"), max_tokens_per_item=(None,),
                        truncation=("end", "none"))
    body: dict[str, Any] = {"query": request.query, "documents": list(request.items), "return_documents": False}
    if request.instruction is not None:
        body["instruct"] = request.instruction
    return "/v1/rerank", body


def decode_score_response(body: Any, request: ScoreRequest, model: str | None = None) -> ScoreResponse:
    """``{"scores": [[p_label0, ...] per item]}`` in input order; the score is the first label's value."""
    scores = body["scores"]
    count = len(request.items)
    if len(scores) != count:
        raise RemoteError(f"{SCORE} returned {len(scores)} scores for {count} items")
    pooled = body.get("pooled_hidden_states") if request.return_pooled_hidden_states else None
    if request.return_pooled_hidden_states and (pooled is None or len(pooled) != count):
        raise RemoteError(f"{SCORE} did not return a pooled hidden state per item")
    results = []
    for index, values in enumerate(scores):
        values = values if isinstance(values, list) else [values]
        if not values or not all(isinstance(value, (int, float)) and not isinstance(value, bool)
                                 and math.isfinite(value) for value in values):
            raise RemoteError(f"{SCORE} returned {values!r:.80} for item {index}: not finite numbers")
        result = scored(index, values[0] if request.label_token_ids is not None else activated(values))
        if request.return_label_logprobs:
            result.label_logprobs = probability_logs([float(value) for value in values])
        if pooled is not None:
            result.pooled_hidden_state = [float(value) for value in pooled[index]]
        results.append(result)
    return response(results, body, model, prompt_tokens_of(body.get("usage")))


def decode_rerank_response(body: Any, request: ScoreRequest, model: str | None = None) -> ScoreResponse:
    """A JSON list of ``{"score", "index"}`` sorted by score, put back in input order."""
    results = in_input_order(body, "score", len(request.items), RERANK)
    prompt_tokens = sum(prompt_tokens_of(entry.get("meta_info")) for entry in body)
    return response(results, None, model, prompt_tokens)


def activated(logits: list[Any]) -> float:
    """A classifier's score from its logits, as rerankit's cross-encoder head computes it."""
    values = [float(logit) for logit in logits]
    if len(values) == 1:
        return sigmoid(values[0])
    # softmax(values)[1] = sigmoid(values[1] - logsumexp(values without index 1))
    rest = values[:1] + values[2:]
    top = max(rest)
    return sigmoid(values[1] - (top + math.log(sum(math.exp(value - top) for value in rest))))


def logit(probability: float) -> float:
    """The logit whose sigmoid is ``probability``, kept finite (JSON has no infinity): within +-LOGIT_LIMIT."""
    if probability <= 0.0:
        return -LOGIT_LIMIT
    if probability >= 1.0:
        return LOGIT_LIMIT
    return max(-LOGIT_LIMIT, min(LOGIT_LIMIT, math.log(probability) - math.log1p(-probability)))


# Server side ------------------------------------------------------------------------------------------

def parse_score_request(body: Any) -> ScoreRequest:
    """A ``/v1/score`` body as a ``ScoreRequest``: raw layout with label ids, or a classifier without."""
    wire = parse_wire(ScoreBody, body)
    wire_refuse("temperature", wire.temperature, (1.0,), "label logits are not tempered")
    wire_refuse("return_token_logprobs", wire.return_token_logprobs, (False,), "not offered")
    wire_refuse("score_extraction_token", wire.score_extraction_token, (None,), "scores are read at the item's end")
    wire_refuse_set(wire, ("embed_override_token_id", "query_embed_overrides", "item_embed_overrides"),
                    "embedding overrides are not offered")
    labels = wire.label_token_ids
    if labels is not None and any(isinstance(label, list) for label in labels):
        raise InvalidRequest("label_token_ids", "one list per item is not offered: give one list for all items")
    generative = labels is not None
    # The wire always answers every label's probability, so the engine is asked for all of them.
    return build_request(query=wire.query, items=[wire.items] if isinstance(wire.items, str) else wire.items,
                         mode="generative" if generative else None, template=RAW if generative else None,
                         label_token_ids=labels, apply_softmax=wire.apply_softmax, item_first=wire.item_first,
                         return_pooled_hidden_states=wire.return_pooled_hidden_states,
                         return_label_logprobs=generative)


def parse_rerank_request(body: Any) -> ScoreRequest:
    """A ``/v1/rerank`` body as a ``ScoreRequest``."""
    wire = parse_wire(RerankBody, body)
    return build_request(RERANK_WIRE_NAMES, query=single_text(wire.query, "query"),
                         items=text_list(wire.documents, "documents"), instruction=wire.instruct, top_n=wire.top_n)


def engine_request(request: ScoreRequest) -> ScoreRequest:
    """What the backend is asked for a parsed ``/v1/score`` body: for a classifier (no label ids) the engine's score,
    whatever ``apply_softmax`` says, as that only picks how the reply writes it (the score, or its logit)."""
    if request.label_token_ids is None and not request.apply_softmax:
        return request.model_copy(update={"apply_softmax": True})
    return request


def encode_score_response(response_: ScoreResponse, request: ScoreRequest, model: str | None = None,
                          documents: list[Any] | None = None) -> dict[str, Any]:
    """``/v1/score`` body: every label's probability per item; for a classifier its activated score, or with
    ``apply_softmax: false`` (SGLang's logits) the logit whose sigmoid is that score."""
    def values(result: ScoreResult) -> list[float]:
        if request.label_token_ids is None:
            return [result.score if request.apply_softmax else logit(result.score)]
        if result.label_logprobs is not None:
            return [math.exp(logprob) for logprob in result.label_logprobs]
        return [result.score]

    pooled = ([result.pooled_hidden_state for result in response_.results]
              if request.return_pooled_hidden_states else None)
    return {"scores": [values(result) for result in response_.results], "pooled_hidden_states": pooled,
            "token_logprobs": None, "model": model or response_.model, "usage": openai_usage(response_),
            "object": "scoring"}


def encode_rerank_response(response_: ScoreResponse, request: ScoreRequest, model: str | None = None,
                           documents: list[Any] | None = None) -> list[dict[str, Any]]:
    """``/v1/rerank`` body: a list best first, cut to ``top_n``."""
    return ranked_results(response_, request, "score", "document", documents)


def echoed_documents(body: Any) -> list[Any] | None:
    """The documents unless ``return_documents`` is false (true by default)."""
    return echoed(body, "documents", isinstance(body, dict) and body.get("return_documents", True) is not False)


def error_body(status: int, message: str, param: str | None = None, kind: str | None = None) -> dict[str, Any]:
    """``{"object": "error", "message", "type", "param", "code"}``."""
    return {"object": "error", **openai_error(status, message, param, kind)}


SGLANG_SCORE = Dialect(
    name="sglang-score", paths=("/v1/score",), max_items=256,
    encode_request=encode_score_request, decode_response=decode_score_response,
    parse_request=parse_score_request, encode_response=encode_score_response, error_body=error_body,
    request_body=ScoreBody, engine_request=engine_request, wire_names=LABELLED,
    markers=tuple(frozenset({field}) for field in (
        "query", "label_token_ids", "apply_softmax", "temperature", "return_token_logprobs", "item_first",
        "return_pooled_hidden_states", "score_extraction_token", "embed_override_token_id")))
SGLANG_RERANK = Dialect(
    name="sglang-rerank", paths=("/v1/rerank",), max_items=256,
    encode_request=encode_rerank_request, decode_response=decode_rerank_response,
    parse_request=parse_rerank_request, encode_response=encode_rerank_response, error_body=error_body,
    request_body=RerankBody, echoed_documents=echoed_documents,
    wire_names=RERANK_WIRE_NAMES,
    markers=(frozenset({"instruct"}), frozenset({"return_documents"})))
