"""The one request/response schema that every backend (embedded, remote, server) speaks.

It imports nothing of rerankit but the error hierarchy and the templates (both leaf modules, no torch), so that a
bad request raises the same typed ``InvalidRequest`` wherever it is built.
"""

from __future__ import annotations

import functools
import types
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from rerankit.errors import InvalidRequest
from rerankit.templates import Template, template_from_dict

Mode = Literal["generative", "cross-encoder", "bi-encoder", "late-interaction"]
MODES: tuple[str, ...] = ("generative", "cross-encoder", "bi-encoder", "late-interaction")
Truncation = Literal["end", "start", "none"]
LongDocuments = Literal["truncate", "max", "mean"]
TokenIds = list[int]
MAX_LABELS = 128


def invalid_from(exc: ValidationError, whole: str = "request") -> InvalidRequest:
    """The first pydantic error as an ``InvalidRequest`` naming the field path (``whole`` where it has none); an
    ``InvalidRequest`` a validator raised with its own field (a template's piece) as it is."""
    first = exc.errors()[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, InvalidRequest):
        return cause
    field = ".".join(str(part) for part in first.get("loc", ())) or whole
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return InvalidRequest(field, message)


# Where a field's values may hold a number: (the refusal of a bool in its place, or None where a bool is taken or
# no number is asked for; the same for the elements of each list type it may be). Worked out once a field.
_Plan = tuple[Optional[str], tuple[Any, ...]]
_NO_NUMBER: _Plan = (None, ())


def _plan(annotation: Any) -> _Plan:
    arms = _arms(annotation)
    takes_bool = any(arm in (bool, Any) or (get_origin(arm) is Literal and any(isinstance(choice, bool)
                                                                             for choice in get_args(arm)))
                     for arm in arms)
    kind = None if takes_bool else "integer" if int in arms else "number" if float in arms else None
    elements = tuple(element for arm in arms if get_origin(arm) is list and get_args(arm)
                     for element in [_plan(get_args(arm)[0])] if element != _NO_NUMBER)
    return (None if kind is None else f"Input should be a valid {kind}, not a boolean"), elements


def _refusal(plan: _Plan, value: Any) -> str | None:
    why, elements = plan
    if isinstance(value, bool):
        return why
    if not elements or not isinstance(value, list):
        return None
    kinds = set(map(type, value))  # a long list (token ids) is looked at once
    for element_why, inner in elements:
        if bool in kinds and element_why is not None:
            return element_why
        for item in value if list in kinds and inner else ():
            if isinstance(item, list) and (why := _refusal((element_why, inner), item)):
                return why
    return None


def _arms(annotation: Any) -> list[Any]:
    """The types a field may take: a union's members, each ``Annotated`` type as its own."""
    if get_origin(annotation) is Annotated:
        return _arms(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        return [arm for member in get_args(annotation) for arm in _arms(member)]
    return [annotation]


@functools.lru_cache(maxsize=None)
def _field_plan(model: type[BaseModel], name: str) -> _Plan:
    field = model.model_fields.get(name)
    return _NO_NUMBER if field is None else _plan(field.annotation)


class NoBoolNumbers(BaseModel):
    """Base of every request model (``ScoreRequest``, the servers' wire bodies): a bool where a number belongs
    (``top_n: true``, ``[true]`` as token ids) is refused, naming the field, as a text there is. Pydantic's lax mode
    would take ``true`` as 1 there -- ``top_n: true`` as one result -- which no client means."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        plan = _field_plan(cls, info.field_name or "")
        why = None if plan == _NO_NUMBER else _refusal(plan, value)
        if why is not None:
            raise ValueError(why)
        return value


class _Strict(NoBoolNumbers):
    """Base for request models: typed errors at construction, unknown fields refused."""

    model_config = ConfigDict(extra="forbid")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise invalid_from(exc) from None

    @classmethod
    def parse(cls, data: Any) -> "_Strict":
        """Validate a dict (e.g. a JSON body), raising ``InvalidRequest`` on bad input."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise invalid_from(exc) from None


class ScoreRequest(_Strict):
    """Score every item against one query. Results come back one per item, in input order."""

    query: Union[str, TokenIds] = Field(description="Query text, or its token ids.")
    items: Union[list[str], list[TokenIds]] = Field(description="Documents: all texts or all token-id lists.")
    mode: Mode | None = Field(default=None, description="Scoring mode; inferred from the model when None.")
    template: Union[str, Template, None] = Field(
        default=None, description="Prompt template: a registered name, or its pieces; detected from the model when None.")
    label_token_ids: TokenIds | None = Field(default=None, description="Label token ids; the first is the positive one.")
    labels: list[str] | None = Field(default=None, description="Label strings, resolved to single tokens by the template.")
    apply_softmax: bool = Field(default=True, description="Softmax over the labels only; False: full-vocabulary probability.")
    item_first: bool = Field(default=False, description="Raw mode: item before query.")
    add_special_tokens: bool = Field(default=True, description="Raw mode: special tokens on the query (never on items).")
    instruction: str | None = Field(default=None, description="Task instruction for templates that take one.")
    top_n: int | None = Field(default=None, ge=1, description="Keep the n best in ``ranked()``; None keeps all.")
    return_pooled_hidden_states: bool = False
    return_label_logprobs: bool = False
    raw_scores: bool = Field(
        default=False, description="Scores before their activation: a cross-encoder's or generative reranker's "
                                   "logit, log(p / (1 - p)) of the probability it scores by default; bi-encoder "
                                   "and late-interaction scores have no activation and are the same.")
    max_tokens_per_item: int | None = Field(default=None, ge=1, description="Cut each item to this many tokens.")
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1,
                          description="A server's queue order, lower first (vLLM's and Cohere's priority); the "
                                      "embedded engine, which has no queue, ignores it.")
    truncation: Truncation = Field(default="end", description="Cut an item's end or start to fit; 'none' refuses.")
    multi_item: bool = Field(default=True, description="Share the prefix among items in one sequence (generative).")
    mis_delimiter_token_id: int | None = Field(default=None, ge=0, description="Raw MIS delimiter token (SGLang layout).")
    long_documents: LongDocuments = Field(
        default="truncate", description="An item longer than the model takes: 'truncate' it, or score it in windows "
                                        "and keep the 'max' or 'mean' of their scores.")
    long_document_window: int | None = Field(
        default=None, ge=1, description="Document tokens per window; None: all the model leaves after the prompt.")
    long_document_stride: int | None = Field(
        default=None, ge=1, description="Tokens between window starts; None: 3/4 of the window (1/4 overlap).")
    long_document_max_windows: int | None = Field(
        default=None, ge=1, description="Windows scored per item at most (the rest of the item is not scored).")

    @field_validator("template", mode="before")
    @classmethod
    def _template_from_pieces(cls, template: Any) -> Any:
        return template_from_dict(template) if isinstance(template, dict) else template

    @field_validator("query")
    @classmethod
    def _query_not_empty(cls, query: Union[str, TokenIds]) -> Union[str, TokenIds]:
        if isinstance(query, str) and not query.strip():
            raise ValueError("must not be empty")
        if isinstance(query, str) and not is_valid_text(query):
            raise ValueError("holds a lone UTF-16 surrogate: not valid text")
        if isinstance(query, list):
            if not query:
                raise ValueError("must not be an empty token list")
            if min(query) < 0:
                raise ValueError("token ids must be >= 0")
        return query

    @field_validator("items", mode="before")
    @classmethod
    def _items_homogeneous(cls, items: Any) -> Any:
        if isinstance(items, (str, bytes)):
            raise ValueError("must be a list of texts or of token-id lists, not a single string")
        if isinstance(items, list):
            if not items:
                raise ValueError("must hold at least one item")
            kinds = {type(item).__name__ for item in items}
            if len(kinds) > 1:
                raise ValueError(f"mixes item types ({', '.join(sorted(kinds))}): give all texts or all token-id lists")
            if isinstance(items[0], str):
                for position, item in enumerate(items):
                    if not is_valid_text(item):
                        raise ValueError(f"item {position} holds a lone UTF-16 surrogate: not valid text")
            if isinstance(items[0], list):
                for position, item in enumerate(items):
                    if not item:
                        raise ValueError(f"item {position} is an empty token list")
                    if any(not isinstance(tok, int) or tok < 0 for tok in item):
                        raise ValueError(f"item {position} has a token id that is not an int >= 0")
        return items

    @field_validator("label_token_ids")
    @classmethod
    def _label_ids_in_bounds(cls, ids: TokenIds | None) -> TokenIds | None:
        if ids is None:
            return ids
        if not ids:
            raise ValueError("must hold at least one label id")
        if len(ids) > MAX_LABELS:
            raise ValueError(f"holds {len(ids)} label ids; the limit is {MAX_LABELS}")
        if min(ids) < 0:
            raise ValueError("label ids must be >= 0")
        return ids

    @field_validator("labels")
    @classmethod
    def _labels_in_bounds(cls, labels: list[str] | None) -> list[str] | None:
        if labels is None:
            return labels
        if not labels:
            raise ValueError("must hold at least one label")
        if len(labels) > MAX_LABELS:
            raise ValueError(f"holds {len(labels)} labels; the limit is {MAX_LABELS}")
        return labels

    @model_validator(mode="after")
    def _labels_once(self) -> "ScoreRequest":
        if self.label_token_ids is not None and self.labels is not None:
            raise ValueError("give label_token_ids or labels, not both")
        return self

    @model_validator(mode="after")
    def _window_fields_need_windows(self) -> "ScoreRequest":
        if self.long_documents == "truncate":
            for field in ("long_document_window", "long_document_stride", "long_document_max_windows"):
                if getattr(self, field) is not None:
                    raise InvalidRequest(field, "only applies with long_documents 'max' or 'mean'")
        if self.long_documents != "truncate" and (self.return_label_logprobs or self.return_pooled_hidden_states):
            raise InvalidRequest("long_documents", "a windowed item has one score per window: it returns no "
                                 "label log-probs or hidden states")
        return self

    @property
    def items_are_token_ids(self) -> bool:
        """True when the items are given as token ids rather than texts."""
        return isinstance(self.items[0], list)


    def with_items(self, start: int, stop: int) -> "ScoreRequest":
        """This request over ``items[start:stop]`` only (same query and options); itself when that is every item."""
        if start == 0 and stop >= len(self.items):
            return self
        return self.model_copy(update={"items": self.items[start:stop]})


class ScoreResult(BaseModel):
    """The score of one input item; ``index`` is its position in the request's ``items``."""

    index: int
    score: float
    label_logprobs: list[float] | None = None
    pooled_hidden_state: list[float] | None = None
    windows: int = 1  # windows the item was scored in (``long_documents``); 1 when it fit


class Usage(BaseModel):
    """Token counts: as if each pair were scored alone, and what was computed after prefix sharing."""

    prompt_tokens: int = 0
    computed_tokens: int = 0


class ScoreResponse(BaseModel):
    """One result per input item, in input order; ``ranked()`` gives them best first."""

    results: list[ScoreResult]
    model: str
    usage: Usage = Field(default_factory=Usage)

    @model_validator(mode="after")
    def _one_result_per_item_in_order(self) -> "ScoreResponse":
        for position, result in enumerate(self.results):
            if result.index != position:
                raise ValueError(f"results[{position}] has index {result.index}: results must be in input order")
        return self

    @classmethod
    def joined(cls, parts: list[tuple[int, "ScoreResponse"]]) -> "ScoreResponse":
        """One response from the responses of a request's consecutive pieces, given as (the piece's first item in
        the request, its response) in any order: results rebased and in order, usage summed, the first piece's
        model. ``ValueError`` where the pieces leave a gap or overlap."""
        parts = sorted(parts, key=lambda part: part[0])
        results = [result.model_copy(update={"index": start + result.index})
                   for start, response in parts for result in response.results]
        usage = Usage(prompt_tokens=sum(response.usage.prompt_tokens for _, response in parts),
                      computed_tokens=sum(response.usage.computed_tokens for _, response in parts))
        return cls(results=results, model=parts[0][1].model, usage=usage)

    def ranked(self, top_n: int | None = None) -> list[ScoreResult]:
        """Results sorted by score, best first, ties broken by input index; the first ``top_n``."""
        order = sorted(self.results, key=lambda result: (-result.score, result.index))
        return order if top_n is None else order[:top_n]

    @property
    def scores(self) -> list[float]:
        """The scores in input order."""
        return [result.score for result in self.results]


class ErrorDetail(BaseModel):
    """The payload of an error, as servers send it back."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorBody(BaseModel):
    """``{"error": {...}}``: the error body of rerankit's own routes (the vLLM/OpenAI shape)."""

    error: ErrorDetail


class RankedDocument(BaseModel):
    """A document with its score, as ``Reranker.rank`` returns it best first."""

    index: int
    score: float
    text: str


def is_valid_text(text: str) -> bool:
    """Whether ``text`` is valid Unicode text (no lone UTF-16 surrogate, which no tokenizer takes); an ASCII text
    answers at once."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True

