"""vLLM's scoring routes: ``/generative_scoring`` (label probabilities of a CausalLM), ``/score`` and
``/rerank`` (pooling models: cross-encoders, bi-encoders, late interaction).

Client side, ``top_n`` is never sent: every item must come back, and ``ScoreResponse.ranked`` cuts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema

from rerankit.errors import InvalidRequest
from rerankit.remote.dialects.common import (
    NULL_ONLY,
    TEXTS_SCHEMA,
    TEXT_SCHEMA,
    Dialect,
    LabelIds,
    OptionalText,
    OptionalTexts,
    Text,
    TextOrTokens,
    Texts,
    TextsOrTokens,
    WireBody,
    any_priority,
    build_request,
    echoed,
    in_input_order,
    new_id,
    now,
    openai_error,
    openai_usage,
    parse_wire,
    prompt_tokens_of,
    ranked_results,
    raw_prompt_parts,
    refuse,
    refuse_for_own_head,
    response,
    single_text,
    text_list,
    wire_refuse,
    wire_refuse_set,
    with_model,
    with_priority,
)
from rerankit.schema import ScoreRequest, ScoreResponse
from rerankit.templates import RAW

GENERATIVE = "vLLM /generative_scoring"
POOLING_MODES = (None, "cross-encoder", "bi-encoder", "late-interaction")
# The (query, documents) field pairs /score accepts, in vLLM's order of preference.
SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
# Fields of /score and /rerank that no other dialect has (priority and max_tokens_per_doc are Cohere's too).
_POOLING_ONLY = ("user", "truncate_prompt_tokens", "truncation_side", "max_tokens_per_query", "instruction",
                 "chat_template_kwargs", "use_activation", "softmax", "activation", "request_id",
                 "mm_processor_kwargs", "cache_salt", "padding")
# The /score and /rerank fields that set a ScoreRequest's differently named ones.
_POOLING_NAMES = {"max_tokens_per_item": "max_tokens_per_doc", "truncation": "truncate_prompt_tokens"}


class GenerativeScoringBody(WireBody):
    """``POST /generative_scoring``."""

    model: str | None = None
    query: TextOrTokens
    items: TextsOrTokens
    label_token_ids: LabelIds
    apply_softmax: bool = True
    item_first: bool = False
    add_special_tokens: bool = True
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = None


class PoolingFields(WireBody):
    """The fields ``/score`` and ``/rerank`` share."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int | None, WithJsonSchema({"enum": [-1, None]})] = Field(default=None, ge=-1)
    truncation_side: Annotated[Literal["left", "right"] | None, WithJsonSchema({"enum": ["right", None]})] = None
    max_tokens_per_query: Annotated[int, WithJsonSchema({"const": 0})] = Field(default=0, ge=0)
    max_tokens_per_doc: int = Field(default=0, ge=0)
    instruction: str | None = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, NULL_ONLY] = None
    use_activation: bool | None = None  # false: raw logits (``ScoreRequest.raw_scores``)
    softmax: bool | None = None  # softmax and activation: use_activation's old names, read where it is not given
    activation: bool | None = None
    priority: int = 0
    request_id: str | None = None
    mm_processor_kwargs: Annotated[dict[str, Any] | None, NULL_ONLY] = None
    cache_salt: str | None = None
    padding: Annotated[Any, NULL_ONLY] = None


class ScoreBody(PoolingFields):
    """``POST /score``: one of four (query, documents) field pairs."""

    # Any pair makes a body: the schema says so, for clients generating bodies from /openapi.json.
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": list(pair), "properties": {pair[0]: TEXT_SCHEMA, pair[1]: TEXTS_SCHEMA}}
        for pair in SCORE_PAIRS]})

    queries: OptionalText = None
    documents: OptionalTexts = None
    items: OptionalTexts = None
    data_1: OptionalText = None
    data_2: OptionalTexts = None
    text_1: OptionalText = None
    text_2: OptionalTexts = None


class RerankBody(PoolingFields):
    """``POST /rerank``, ``/v1/rerank``, ``/v2/rerank``."""

    query: Text
    documents: Texts
    top_n: int = Field(default=0, ge=0)


# Client side ------------------------------------------------------------------------------------------

def encode_generative_request(request: ScoreRequest, model: str | None) -> tuple[str, dict[str, Any]]:
    """``/generative_scoring`` body: raw layout, the caller's label ids (a text template is rendered here)."""
    refuse(request, GENERATIVE, mode=(None, "generative"), labels=(None,),
           return_pooled_hidden_states=(False,), return_label_logprobs=(False,), max_tokens_per_item=(None,),
           truncation=("end",), mis_delimiter_token_id=(None,), **any_priority(request))
    query, items, instruction = raw_prompt_parts(request, GENERATIVE)
    if instruction is not None:
        raise InvalidRequest("instruction", f"{GENERATIVE} has no instruction; use a template that takes one")
    if request.label_token_ids is None:
        raise InvalidRequest("label_token_ids", f"{GENERATIVE} needs label_token_ids (the first is the positive)")
    body = {"query": query, "items": items, "label_token_ids": request.label_token_ids,
            "apply_softmax": request.apply_softmax, "item_first": request.item_first,
            "add_special_tokens": request.add_special_tokens}
    return "/generative_scoring", with_model(with_priority(body, request), model)


def _pooling_options(request: ScoreRequest, endpoint: str) -> dict[str, Any]:
    """The refusals and truncation fields common to ``/score`` and ``/rerank``."""
    refuse_for_own_head(request, endpoint, mode=POOLING_MODES, truncation=("end", "none"), raw_scores=(False, True),
                        **any_priority(request))
    options: dict[str, Any] = with_priority({}, request)
    if request.raw_scores:
        options["use_activation"] = False
    if request.instruction is not None:
        options["instruction"] = request.instruction
    if request.truncation == "end":
        options["truncate_prompt_tokens"] = -1
        if request.max_tokens_per_item is not None:
            options["max_tokens_per_doc"] = request.max_tokens_per_item
    elif request.max_tokens_per_item is not None:
        raise InvalidRequest("max_tokens_per_item", f"{endpoint} cuts documents to max_tokens_per_doc; "
                                                    "it cannot refuse them under truncation='none'")
    return options


def encode_score_request(request: ScoreRequest, model: str | None) -> tuple[str, dict[str, Any]]:
    """``/score`` body with ``queries`` and ``documents``."""
    options = _pooling_options(request, "vLLM /score")
    return "/score", with_model({"queries": request.query, "documents": list(request.items), **options}, model)


def encode_rerank_request(request: ScoreRequest, model: str | None) -> tuple[str, dict[str, Any]]:
    """``/rerank`` body; no ``top_n``, so that every document comes back."""
    options = _pooling_options(request, "vLLM /rerank")
    return "/rerank", with_model({"query": request.query, "documents": list(request.items), **options}, model)


def decode_data_response(body: Any, request: ScoreRequest, model: str | None = None) -> ScoreResponse:
    """``{"data": [{"index", "score"}]}`` of ``/generative_scoring`` and ``/score``."""
    results = in_input_order(body["data"], "score", len(request.items), "vLLM")
    return response(results, body, model, prompt_tokens_of(body.get("usage")))


def decode_rerank_response(body: Any, request: ScoreRequest, model: str | None = None) -> ScoreResponse:
    """``{"results": [{"index", "relevance_score"}]}`` sorted by score, put back in input order."""
    results = in_input_order(body["results"], "relevance_score", len(request.items), "vLLM /rerank")
    return response(results, body, model, prompt_tokens_of(body.get("usage")))


# Server side ------------------------------------------------------------------------------------------

def parse_generative_request(body: Any) -> ScoreRequest:
    """A ``/generative_scoring`` body as a raw-layout generative ``ScoreRequest``."""
    wire = parse_wire(GenerativeScoringBody, body)
    # vLLM cuts too-long prompts at the end; rerankit cuts the item's end, never the suffix.
    return build_request(query=wire.query, items=wire.items, mode="generative", template=RAW,
                         label_token_ids=wire.label_token_ids, apply_softmax=wire.apply_softmax,
                         item_first=wire.item_first, add_special_tokens=wire.add_special_tokens,
                         priority=wire.priority)


def _pooling_request(wire: PoolingFields, query: str, documents: list[str], names: dict[str, str],
                     top_n: int | None = None) -> ScoreRequest:
    """The ``ScoreRequest`` of a ``/score`` or ``/rerank`` body, refusing what the engine does not offer."""
    activation = next((value for value in (wire.use_activation, wire.softmax, wire.activation) if value is not None),
                      True)
    wire_refuse("max_tokens_per_query", wire.max_tokens_per_query, (0,), "the query is never cut")
    wire_refuse("truncation_side", wire.truncation_side, (None, "right"), "the query is never cut")
    wire_refuse("truncate_prompt_tokens", wire.truncate_prompt_tokens, (None, -1),
                "a whole-prompt cap is not offered; use max_tokens_per_doc, or -1 for the model's limit")
    wire_refuse_set(wire, ("chat_template_kwargs", "mm_processor_kwargs", "padding"), "not offered")
    cuts = wire.truncate_prompt_tokens == -1 or wire.max_tokens_per_doc > 0
    return build_request(names, query=query, items=documents, instruction=wire.instruction, top_n=top_n,
                         max_tokens_per_item=wire.max_tokens_per_doc or None,
                         truncation="end" if cuts else "none", raw_scores=not activation, priority=wire.priority)


def parse_score_request(body: Any) -> ScoreRequest:
    """A ``/score`` body (any of its four field pairs) as a ``ScoreRequest``."""
    wire = parse_wire(ScoreBody, body)
    given = [pair for pair in SCORE_PAIRS if getattr(wire, pair[0]) is not None and getattr(wire, pair[1]) is not None]
    if not given:
        raise InvalidRequest("queries", "give queries and documents (or data_1/data_2, text_1/text_2)")
    query_field, documents_field = given[0]
    query = single_text(getattr(wire, query_field), query_field)
    documents = text_list(getattr(wire, documents_field), documents_field)
    return _pooling_request(wire, query, documents, {"query": query_field, "items": documents_field})


def parse_rerank_request(body: Any) -> ScoreRequest:
    """A ``/rerank`` body as a ``ScoreRequest``; ``top_n`` 0 means every document."""
    wire = parse_wire(RerankBody, body)
    query = single_text(wire.query, "query")
    documents = text_list(wire.documents, "documents")
    return _pooling_request(wire, query, documents, {"items": "documents"}, wire.top_n or None)


def encode_data_response(response_: ScoreResponse, request: ScoreRequest, model: str | None = None,
                         documents: list[Any] | None = None) -> dict[str, Any]:
    """``/generative_scoring`` and ``/score`` body: scores in input order."""
    data = [{"index": result.index, "object": "score", "score": result.score} for result in response_.results]
    return {"id": new_id("score"), "object": "list", "created": now(), "model": model or response_.model,
            "data": data, "usage": openai_usage(response_)}


def encode_rerank_response(response_: ScoreResponse, request: ScoreRequest, model: str | None = None,
                           documents: list[Any] | None = None) -> dict[str, Any]:
    """``/rerank`` body: best first, cut to ``top_n``, each with its document (vLLM always echoes them)."""
    results = ranked_results(response_, request, "relevance_score", "document.text", documents)
    tokens = response_.usage.prompt_tokens
    return {"id": new_id("rerank"), "model": model or response_.model, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def error_body(status: int, message: str, param: str | None = None, kind: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, the HTTP status in ``code``."""
    return {"error": openai_error(status, message, param, kind)}


VLLM_GENERATIVE = Dialect(
    name="vllm-generative", paths=("/generative_scoring",), max_items=256,
    encode_request=encode_generative_request, decode_response=decode_data_response,
    parse_request=parse_generative_request, encode_response=encode_data_response, error_body=error_body,
    request_body=GenerativeScoringBody, wire_names={"mode": "label_token_ids", "template": "label_token_ids"})
VLLM_SCORE = Dialect(
    name="vllm-score", paths=("/score", "/v1/score"), max_items=256,
    encode_request=encode_score_request, decode_response=decode_data_response,
    parse_request=parse_score_request, encode_response=encode_data_response, error_body=error_body,
    request_body=ScoreBody, wire_names={"query": "queries", "items": "documents", **_POOLING_NAMES},
    markers=tuple(frozenset({field}) for field in ("queries", "data_1", "text_1", "documents", *_POOLING_ONLY)))
VLLM_RERANK = Dialect(
    name="vllm-rerank", paths=("/rerank", "/v1/rerank", "/v2/rerank"), max_items=256,
    encode_request=encode_rerank_request, decode_response=decode_rerank_response,
    parse_request=parse_rerank_request, encode_response=encode_rerank_response, error_body=error_body,
    request_body=RerankBody, echoed_documents=lambda body: echoed(body, "documents", True),
    wire_names={"items": "documents", **_POOLING_NAMES},
    markers=tuple(frozenset({field}) for field in _POOLING_ONLY))
