"""What every wire dialect shares: the ``Dialect`` record, refusals, result order, usage and error bodies.

Everything here is a pure function of its arguments (no I/O), so that the sync client, the async client
and the server routes all run the same code.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Annotated, Any, Callable, Iterable, Mapping, Union

from pydantic import ConfigDict, ValidationError, WithJsonSchema

from rerankit.errors import InvalidRequest, RemoteError
from rerankit.schema import (ErrorDetail, NoBoolNumbers, ScoreRequest, ScoreResponse, ScoreResult, Usage,
                             invalid_from)
from rerankit.templates import RAW, get_template

log = logging.getLogger("rerankit.server")

# Wire fields read by ``single_text``/``text_list`` (whose errors name the field), typed for the OpenAPI schema.
TEXT_SCHEMA = {"type": "string", "pattern": r"\S"}
TEXT_LIST_SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 1}
TEXTS_SCHEMA = {"anyOf": [TEXT_SCHEMA, TEXT_LIST_SCHEMA]}
TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
ITEMS_SCHEMA = {"anyOf": [TEXT_LIST_SCHEMA, {"type": "array", "items": TOKEN_IDS_SCHEMA, "minItems": 1}]}
NULL_SCHEMA = {"type": "null"}
Text = Annotated[Any, WithJsonSchema(TEXT_SCHEMA)]
Texts = Annotated[Any, WithJsonSchema(TEXTS_SCHEMA)]
OptionalText = Annotated[Any, WithJsonSchema({"anyOf": [TEXT_SCHEMA, NULL_SCHEMA]})]
OptionalTexts = Annotated[Any, WithJsonSchema({"anyOf": [TEXT_SCHEMA, TEXT_LIST_SCHEMA, NULL_SCHEMA]})]
TextOrTokens = Annotated[Union[str, list[int]], WithJsonSchema({"anyOf": [TEXT_SCHEMA, TOKEN_IDS_SCHEMA]})]
TextsOrTokens = Annotated[Union[list[str], list[list[int]]], WithJsonSchema(ITEMS_SCHEMA)]
LabelIds = Annotated[list[int], WithJsonSchema(TOKEN_IDS_SCHEMA)]
# Fields whose other values are refused with a clear error: the schema publishes only what is honoured.
TRUE_OR_NULL = WithJsonSchema({"enum": [True, None]})
NULL_ONLY = WithJsonSchema(NULL_SCHEMA)

# Why a field cannot travel to a server, when the bare "cannot honour" says too little.
_REASONS = {
    "labels": "label strings need the model's tokenizer; pass label_token_ids",
    "template": "the server formats the prompt itself",
    "apply_softmax": "its scores are the model's activated outputs, not label probabilities",
    "return_label_logprobs": "it returns one score per item",
    "return_pooled_hidden_states": "it returns no hidden states",
    "mis_delimiter_token_id": "multi-item scoring is a server setting there",
    "max_tokens_per_item": "it has no per-item token limit",
    "label_token_ids": "it scores with the model's own head",
    "long_documents": "scoring a long item in windows is done by rerankit's engine (serve the model with "
                      "rerankit serve, or send Cohere v1's max_chunks_per_doc to it)",
    "raw_scores": "it returns activated scores only",
    "priority": "it takes no request priority (the server orders its own queue)",
}
# What no peer's wire carries: windows of a long item are scored and aggregated by rerankit's engine only.
_EVERY_ROUTE: dict[str, tuple[Any, ...]] = {"long_documents": ("truncate",), "raw_scores": (False,), "priority": (0,)}


def any_priority(request: ScoreRequest) -> dict[str, tuple[Any, ...]]:
    """``refuse``'s allowance for a route whose body carries ``priority`` (vLLM's, Cohere's): every value."""
    return {"priority": (request.priority,)}


def with_priority(body: dict[str, Any], request: ScoreRequest) -> dict[str, Any]:
    """The body with the request's ``priority`` where it is not the default 0 (a server without priority
    scheduling, such as vLLM's default, then keeps taking the request)."""
    return {**body, "priority": request.priority} if request.priority else body
# The one value (rerankit's default) that a route scoring with the model's own head takes for these fields.
_OWN_HEAD: dict[str, tuple[Any, ...]] = {
    "template": (None,), "label_token_ids": (None,), "labels": (None,), "apply_softmax": (True,),
    "item_first": (False,), "add_special_tokens": (True,), "return_pooled_hidden_states": (False,),
    "return_label_logprobs": (False,), "mis_delimiter_token_id": (None,),
}


class WireBody(NoBoolNumbers):
    """Base of the server-side request models: unknown fields are ignored (logged at debug), as vLLM and SGLang
    do; a field the model names but rerankit cannot honour is refused by the dialect's parser; a bool where a
    number belongs is refused (``NoBoolNumbers``)."""

    model_config = ConfigDict(extra="ignore")


@dataclass(frozen=True)
class Dialect:
    """One wire format, both ways: client (encode request, decode response), server (parse, encode, errors).

    ``paths`` are the routes that speak it, the first being where the client posts; ``max_items`` is the
    most items the client puts in one request unless told otherwise; ``request_body`` is the server's model of
    a request body; ``markers`` are the sets of fields that, all present and not null, show a body is in this
    dialect (a server path shared by several dialects weighs them, see ``rerankit.server.routes``);
    ``requires_model``: the server refuses a body without ``model`` (Cohere), so the client finds one to send.
    ``engine_request``: what the server asks its backend for a parsed request, which ``encode_response`` still gets
    (SGLang's ``apply_softmax`` on a classifier only picks how the reply writes the score).
    ``wire_names``: the body's name of a ``ScoreRequest`` field where they differ, for a refusal that names it.
    ``path_variants``: fields replaced where the dialect answers on a path of its own (``at``).
    """

    name: str
    paths: tuple[str, ...]
    max_items: int
    encode_request: Callable[[ScoreRequest, str | None], tuple[str, dict[str, Any]]]
    decode_response: Callable[..., ScoreResponse]
    parse_request: Callable[[Any], ScoreRequest]
    encode_response: Callable[..., Any]
    error_body: Callable[..., dict[str, Any]]
    request_body: type[WireBody]
    echoed_documents: Callable[[Any], list[Any] | None] = lambda body: None
    markers: tuple[frozenset[str], ...] = ()
    requires_model: bool = False
    engine_request: Callable[[ScoreRequest], ScoreRequest] = lambda request: request
    wire_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    path_variants: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def at(self, path: str) -> "Dialect":
        """This dialect as it answers on the server's ``path``: with ``path_variants``' fields for it (Cohere's
        ``/v1/rerank`` replies as its v1 API does)."""
        changed = self.path_variants.get(path)
        return dataclasses.replace(self, **changed) if changed else self

    def claimed(self, present: set[str]) -> set[str]:
        """The ``present`` fields this dialect's markers claim (none: the body says nothing of it)."""
        claimed: set[str] = set()
        for marker in self.markers:
            if marker <= present:
                claimed |= marker
        return claimed

    def decode(self, body: Any, request: ScoreRequest, model: str | None = None) -> ScoreResponse:
        """``decode_response`` with a malformed body turned into a ``RemoteError`` (numbers out of range too:
        ``OverflowError`` from a score of ``10**400`` or a token count of ``Infinity``)."""
        try:
            return self.decode_response(body, request, model)
        except (KeyError, TypeError, IndexError, AttributeError, ValueError, ArithmeticError) as exc:
            raise RemoteError(f"malformed {self.name} response ({type(exc).__name__}: {exc})") from exc


def refuse(request: ScoreRequest, endpoint: str, **allowed: tuple[Any, ...]) -> None:
    """Raise ``InvalidRequest`` for the first field, in the schema's order, whose value is not allowed."""
    # The schema's order, not the caller's: a request breaking two limits gets the same error on every route.
    order = list(ScoreRequest.model_fields)
    allowed = {**_EVERY_ROUTE, **allowed}
    for field, values in sorted(allowed.items(), key=lambda limit: order.index(limit[0])):
        value = getattr(request, field)
        if value not in values:
            reason = _REASONS.get(field, f"it takes only {', '.join(repr(v) for v in values)}")
            raise InvalidRequest(field, f"{endpoint} cannot honour {field}={value!r}: {reason}")


def refuse_for_own_head(request: ScoreRequest, endpoint: str, **allowed: tuple[Any, ...]) -> None:
    """``refuse`` for a route that scores texts with the model's own head (``/score``, ``/rerank`` styles).

    Such a route takes texts only, formats no prompt, has no label ids, returns one score per item and does no
    multi-item scoring; ``allowed`` adds the route's own limits (mode, instruction, truncation...).
    """
    require_texts(request, endpoint)
    refuse(request, endpoint, **_OWN_HEAD, **allowed)


def require_texts(request: ScoreRequest, endpoint: str) -> None:
    """Refuse token-id queries and items where the wire only carries texts."""
    if not isinstance(request.query, str):
        raise InvalidRequest("query", f"{endpoint} takes a text query, not token ids")
    if request.items_are_token_ids:
        raise InvalidRequest("items", f"{endpoint} takes text items, not token ids")


def raw_prompt_parts(request: ScoreRequest, endpoint: str) -> tuple[Any, list[Any], str | None]:
    """Query, items and instruction for a server that concatenates query and item as given (raw layout).

    A named text template is rendered here, on the client: the query becomes the template's prefix and each
    item its item text plus suffix, so the server's concatenation yields the template's prompt. The label ids
    must still be given, since label strings need the model's tokenizer.
    """
    if request.template in (None, RAW):
        return request.query, list(request.items), request.instruction
    template = get_template(request.template)
    require_texts(request, f"{endpoint} with template {template.name!r}")
    if request.label_token_ids is None:
        raise InvalidRequest("label_token_ids", f"{endpoint} needs the ids of the template's labels "
                                                f"{template.labels} (resolve them with the model's tokenizer)")
    if request.item_first:
        raise InvalidRequest("item_first", f"template {template.name!r} fixes the order of query and item")
    sep = template.separator
    query = template.prefix(request.instruction, request.query) + sep
    items = [template.item(doc) + sep + template.suffix(request.instruction) for doc in request.items]
    return query, items, None


def with_model(body: dict[str, Any], model: str | None) -> dict[str, Any]:
    """The body with ``model`` set when one is known (servers fall back to their served model)."""
    if model is not None:
        body["model"] = model
    return body


def in_input_order(entries: Iterable[Any], score_field: str, count: int, dialect: str) -> list[ScoreResult]:
    """Wire entries ``{"index", score_field}`` as results in input order; every item must come back exactly once."""
    results = [scored(entry["index"], entry[score_field]) for entry in entries]
    by_index: dict[int, ScoreResult] = {}
    for result in results:
        if not 0 <= result.index < count:
            raise RemoteError(f"{dialect} response has index {result.index} for a request of {count} items")
        if result.index in by_index:
            raise RemoteError(f"{dialect} response has index {result.index} twice")
        by_index[result.index] = result
    if len(by_index) != count:
        missing = sorted(set(range(count)) - set(by_index))
        raise RemoteError(f"{dialect} response misses items {missing[:10]} of {count}")
    return [by_index[index] for index in range(count)]


def scored(index: Any, score: Any) -> ScoreResult:
    """A ``ScoreResult`` from wire values, refusing a non-integer index and a score that is not a finite number."""
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"index {index!r} is not an integer")
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise TypeError(f"score of item {index} is {score!r}, not a number")
    # JSON NaN and Infinity parse to floats, and a huge integer overflows one: none of them ranks anything.
    if isinstance(score, int) and abs(score) > 2**1023 or not math.isfinite(score):
        raise ValueError(f"score of item {index} is {score!r:.40}, not a finite number")
    return ScoreResult(index=index, score=float(score))


def response(results: list[ScoreResult], body: Any, model: str | None, prompt_tokens: int) -> ScoreResponse:
    """The ``ScoreResponse``; remote servers report prompt tokens only, so computed = prompt tokens."""
    wire_model = body.get("model") if isinstance(body, dict) else None
    return ScoreResponse(results=results, model=wire_model or model or "unknown",
                         usage=Usage(prompt_tokens=prompt_tokens, computed_tokens=prompt_tokens))


def prompt_tokens_of(usage: Any) -> int:
    """``usage.prompt_tokens`` (or ``total_tokens``) of an OpenAI-style usage object, 0 when absent."""
    if not isinstance(usage, dict):
        return 0
    return int(usage.get("prompt_tokens") or usage.get("total_tokens") or 0)


def openai_usage(response_: ScoreResponse) -> dict[str, int]:
    """``usage`` of vLLM and SGLang responses: scoring produces no completion tokens."""
    tokens = response_.usage.prompt_tokens
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def new_id(kind: str) -> str:
    """A response id in the servers' style, e.g. ``rerank-3f2a...``."""
    return f"{kind}-{uuid.uuid4().hex}"


def now() -> int:
    """``created``: Unix seconds."""
    return int(time.time())


def sigmoid(value: float) -> float:
    """Sigmoid without overflow for large negative values (a logit as the probability rerankit scores)."""
    if value >= 0:
        return 1.0 / (1.0 + math.exp(-value))
    small = math.exp(value)
    return small / (1.0 + small)


def probability_logs(values: list[float]) -> list[float]:
    """Log of each label probability; a probability of 0 is a log-probability of -inf."""
    return [math.log(value) if value > 0 else -math.inf for value in values]


def parse_wire(model: type[WireBody], body: Any) -> Any:
    """Validate a JSON body against a wire model, raising ``InvalidRequest`` naming the wire field."""
    if not isinstance(body, dict):
        raise InvalidRequest("body", f"must be a JSON object, got {type(body).__name__}")
    fields = model.model_fields
    unknown = sorted(set(body) - set(fields))
    if unknown:  # names come from the client: quoted (no line breaks or escapes reach the log) and cut short
        shown = ", ".join(repr(name[:64]) for name in unknown[:10])
        log.debug("%s: ignoring %d unknown field(s): %s%s", model.__name__, len(unknown), shown,
                  ", ..." if len(unknown) > 10 else "")
    # a known field sent as null is as if left out (clients that dump every optional field send `top_n: null`);
    # a required one stays, to be refused by name
    body = {name: value for name, value in body.items()
            if value is not None or name not in fields or fields[name].is_required()}
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_from(exc, "body") from None


def build_request(wire_names: dict[str, str] | None = None, **fields: Any) -> ScoreRequest:
    """A ``ScoreRequest`` from parsed wire values; an error names the wire field (``items`` -> ``documents``)."""
    try:
        return ScoreRequest(**fields)
    except InvalidRequest as exc:
        root, _, rest = exc.field.partition(".")
        wire_field = (wire_names or {}).get(root, root) + (f".{rest}" if rest else "")
        raise InvalidRequest(wire_field, exc.reason) from None


def wire_refuse(field: str, value: Any, allowed: tuple[Any, ...], why: str) -> None:
    """Server side: refuse a wire field set to a value this server does not offer."""
    if value not in allowed:
        raise InvalidRequest(field, f"{value!r} is not offered: {why}")


def wire_refuse_set(wire: WireBody, fields: Iterable[str], why: str) -> None:
    """Server side: refuse any of ``fields`` that the body sets (null or an empty mapping is not set)."""
    for field in fields:
        wire_refuse(field, getattr(wire, field), (None, {}), why)


def single_text(value: Any, field: str) -> str:
    """A wire field that must hold one text (a one-element list is accepted, as vLLM broadcasts it)."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise InvalidRequest(field, "must be one text (one query per request)")
    return value


def text_list(value: Any, field: str) -> list[str]:
    """A wire field holding texts: one text or a list of them (multimodal content is not offered)."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or any(not isinstance(text, str) for text in texts):
        raise InvalidRequest(field, "must be a text or a list of texts")
    return texts


def ranked_results(response_: ScoreResponse, request: ScoreRequest, score_field: str, document_field: str,
                   documents: list[Any] | None) -> list[dict[str, Any]]:
    """Rerank-style wire results: best first, cut to ``top_n``, each ``{"index", score_field}``.

    With ``documents`` (the body's, see ``echoed``) each also holds its document under ``document_field``; a dotted
    field nests a text (``"document.text"``: ``{"document": {"text": ...}}``), an object document is echoed whole.
    """
    results = []
    for result in response_.ranked(request.top_n):
        entry: dict[str, Any] = {"index": result.index, score_field: result.score}
        if documents is not None:
            outer, _, inner = document_field.partition(".")
            document = documents[result.index]
            entry[outer] = {inner: document} if inner and isinstance(document, str) else document
        results.append(entry)
    return results


def echoed(body: Any, field: str, asked: bool) -> list[Any] | None:
    """The documents of a (parsed, so valid) body's ``field`` to echo in the reply when ``asked``, else None."""
    if not asked or not isinstance(body, dict):
        return None
    documents = body.get(field)
    return [documents] if isinstance(documents, str) else documents


def error_type(status: int) -> str:
    """The OpenAI-style error type of an HTTP status: ``BadRequestError``, ``RateLimitError``..."""
    named = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
             404: "NotFoundError", 409: "ConflictError", 413: "RequestTooLargeError",
             422: "UnprocessableEntityError", 429: "RateLimitError"}
    if status in named:
        return named[status]
    if status >= 500:
        return "InternalServerError"
    try:
        return HTTPStatus(status).phrase.title().replace(" ", "") + "Error"
    except ValueError:
        return "Error"


def openai_error(status: int, message: str, param: str | None, kind: str | None) -> dict[str, Any]:
    """``{"message", "type", "param", "code"}``, the error object of vLLM and SGLang (the status in ``code``)."""
    return ErrorDetail(message=message, type=kind or error_type(status), param=param, code=status).model_dump()


def param_first(message: str, param: str | None) -> str:
    """The message led by the field it is about, for error bodies that have no field of their own."""
    return message if param is None or message.startswith(param) else f"{param}: {message}"


def detail_error(status: int, message: str, param: str | None = None, kind: str | None = None) -> dict[str, Any]:
    """``{"detail": message}``, the field (when known) leading the message: the error body of Jina, Voyage AI and
    FastAPI's own errors."""
    return {"detail": param_first(message, param)}


def read_error(body: Any) -> tuple[str | None, str | None]:
    """Message and param of an error body in any dialect's format (vLLM, SGLang, Cohere, TEI, FastAPI)."""
    if not isinstance(body, dict):
        return None, None
    error = body.get("error")
    if isinstance(error, dict):
        return _text(error.get("message")), _text(error.get("param"))
    if isinstance(error, str):
        return error, None
    if isinstance(body.get("message"), str):
        return body["message"], _text(body.get("param"))
    detail = body.get("detail")
    if isinstance(detail, str):
        return detail, None
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        where = ".".join(str(part) for part in detail[0].get("loc", ()))
        return _text(detail[0].get("msg")), where or None
    return None, None


def _text(value: Any) -> str | None:
    return None if value is None else str(value)
