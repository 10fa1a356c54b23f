"""From a ScoreRequest to token ids: template, one tokenization per part, truncation, and the request checks
that need the model (vocabulary, labels, modes).

Every pair sequence is ``prefix_ids + item_ids[i] + suffix_ids``. The prefix (instruction + query) and the items
of a request go to the tokenizer in one batched call; the parts that do not depend on the query (separator, suffix,
label words, special-token layout, and the prefix's head: system prompt and instruction, where tokenizing it apart
gives the same ids) are tokenized once per tokenizer and kept. Truncation shortens the item only, so
the suffix where the label is read always survives. Bi-encoder and late-interaction requests also carry the query
as its own sequence.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from collections.abc import Sequence as Texts
from typing import Any, Callable, TypeVar

from rerankit.engine.lengths import fit, fit_items, kept_tokens, refuse_huge_texts, tokenize_bounded
from rerankit.engine.load import LoadedModel
from rerankit.engine.resolve import check_fields_apply
from rerankit.errors import InvalidRequest
from rerankit.schema import ScoreRequest
from rerankit.templates import RAW, Template

QUERY_KEY = -1  # the key of a bi-encoder's query sequence; items are keyed by their index
HEAD_PROBE_QUERY = "a"  # a second query on which a template head's separate tokenization is checked
MAX_CACHED_PER_TOKENIZER = 256  # instructions and label words come from requests: keep the newest only

_Value = TypeVar("_Value")
_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()


@dataclass
class Sequence:
    """One sequence to run: its ids, BERT segment ids, and the offset of the token whose state is read."""

    key: int
    input_ids: list[int]
    token_type_ids: list[int] | None
    read_offset: int


@dataclass
class EncodedRequest:
    """A request as token ids, with the parts kept apart so that a planner can share the prefix."""

    mode: str
    prefix_ids: list[int]
    item_ids: list[list[int]]
    suffix_ids: list[int]
    label_ids: list[int]
    read_first: bool
    lone_label_sigmoid: bool = False
    query_ids: list[int] | None = None
    prefix_types: list[int] | None = None
    item_type: int = 0
    suffix_types: list[int] | None = None
    head_len: int = 0  # the prefix's first tokens that do not depend on the query (BOS, system prompt, instruction)
    windows: list[int] | None = None  # per request item, how many of item_ids are its windows; None: one each
    # per request item, its tokens before it was fitted (a template's item text included); a text far longer than
    # what can be kept is tokenized from a bounded slice: at least that many
    item_lengths: list[int] = dataclasses.field(default_factory=list)

    def extend(self, chunk: "EncodedRequest") -> None:
        """Append the items of the next chunk of the same request (``encode_request(..., items=...)``)."""
        if self.windows is not None or chunk.windows is not None:
            self.windows = self.item_windows + chunk.item_windows
        self.item_ids = self.item_ids + chunk.item_ids
        self.item_lengths = self.item_lengths + chunk.item_lengths

    @property
    def item_windows(self) -> list[int]:
        """How many sequences of ``item_ids`` each request item was scored in (``long_documents``)."""
        return self.windows if self.windows is not None else [1] * len(self.item_ids)

    @property
    def pair_lengths(self) -> list[int]:
        """Length of each item's full sequence, as if it were scored alone."""
        fixed = len(self.prefix_ids) + len(self.suffix_ids)
        return [fixed + len(item) for item in self.item_ids]

    @property
    def prompt_tokens(self) -> int:
        """Tokens of every (query, item) pair scored alone: the figure a one-pair-per-sequence server reports."""
        return sum(self.pair_lengths) + len(self.query_ids or ()) * len(self.item_ids)

    def query_sequence(self) -> Sequence | None:
        """The query as its own sequence, for bi-encoders and late interaction; None for pair modes."""
        if self.query_ids is None:
            return None
        return self._sequence(QUERY_KEY, self.query_ids, len(self.query_ids) - len(self.prefix_ids)
                              - len(self.suffix_ids))

    def _sequence(self, key: int, ids: list[int], middle: int) -> Sequence:
        types = None
        if self.prefix_types is not None and self.suffix_types is not None:
            types = self.prefix_types + [self.item_type] * middle + self.suffix_types
        return Sequence(key, ids, types, 0 if self.read_first else len(ids) - 1)


@dataclass(frozen=True)
class SpecialLayout:
    """Where a tokenizer puts its special tokens around one text (``between``/``second_type`` unused) or a pair."""

    before: list[int]
    between: list[int]
    after: list[int]
    before_types: list[int]
    first_type: int
    between_types: list[int]
    second_type: int
    after_types: list[int]


def special_layout(tokenizer: Any, pair: bool) -> SpecialLayout:
    """The tokenizer's special-token layout, found once per tokenizer by locating two one-token sentinels."""
    return _cached(tokenizer, ("layout", pair), lambda: _find_special_layout(tokenizer, pair))


def _find_special_layout(tokenizer: Any, pair: bool) -> SpecialLayout:
    first = tokenizer("a", add_special_tokens=False)["input_ids"]
    second = tokenizer("b", add_special_tokens=False)["input_ids"]
    encoded = tokenizer("a", "b" if pair else None, add_special_tokens=True, return_token_type_ids=True)
    ids = encoded["input_ids"]
    types = encoded.get("token_type_ids") or [0] * len(ids)
    start = _find(ids, first, 0)
    end = start + len(first)
    second_start = _find(ids, second, end) if pair else end
    tail = second_start + len(second) if pair else end
    return SpecialLayout(
        before=ids[:start], between=ids[end:second_start], after=ids[tail:],
        before_types=types[:start], first_type=types[start], between_types=types[end:second_start],
        second_type=types[second_start] if pair else 0, after_types=types[tail:],
    )


def _find(ids: list[int], part: list[int], start: int) -> int:
    for position in range(start, len(ids) - len(part) + 1):
        if ids[position:position + len(part)] == part:
            return position
    raise ValueError(f"cannot locate {part} in the tokenizer's output {ids}")


def encode_request(request: ScoreRequest, loaded: LoadedModel, mode: str, template: Template | None,
                   items: slice | None = None, earlier: EncodedRequest | None = None,
                   item_ids: list[list[int]] | None = None) -> EncodedRequest:
    """Check ``request`` against the model and turn it into token ids; ``InvalidRequest`` names what is wrong.

    ``items`` encodes only ``request.items[items]`` (a chunk, ``step`` 1): errors still name an item by its index
    in the request, and the chunks of one request concatenate to the whole request's encoding. ``earlier``: the
    encoding of an earlier chunk of the same request (same mode and template); every field but the items is taken
    from it, so the query (and a template's instruction) is not tokenized again. ``item_ids``: with ``earlier``,
    the chunk's items as ``later_item_ids`` tokenized them ahead (on another thread); they are fitted here.
    """
    check_fields_apply(request, mode, template)
    chunk = _Chunk(request, items or slice(0, len(request.items)))
    if earlier is not None:
        return _encode_later_chunk(request, loaded, mode, template, chunk, earlier, item_ids)
    refuse_huge_texts(request, loaded.max_length, mode, _tokenizing(loaded.tokenizer))
    if mode == "generative":
        if template is None:
            raise InvalidRequest("template", "no prompt template is known for this model: name one "
                                 "(qwen3-reranker, bge-reranker-gemma, mxbai-rerank-v2) or give label_token_ids")
        if template.name == RAW:
            encoded = _encode_raw(request, loaded, chunk)
        else:
            encoded = _encode_text(request, loaded, template, mode, chunk)
        encoded.label_ids = _label_ids(request, loaded, template)
        encoded.lone_label_sigmoid = template.lone_label_sigmoid and len(encoded.label_ids) == 1
        return encoded
    if mode == "cross-encoder":
        if template is not None:
            return _encode_text(request, loaded, template, mode, chunk)
        return _encode_pair(request, loaded, chunk)
    return _encode_single(request, loaded, mode, chunk)


class _Chunk:
    """The items of a request that one ``encode_request`` call encodes, and the request index of the first."""

    def __init__(self, request: ScoreRequest, items: slice) -> None:
        start, stop, step = items.indices(len(request.items))
        if step != 1:
            raise ValueError("an item chunk must be a contiguous slice")
        self.offset = start
        self.items = request.items if (start, stop) == (0, len(request.items)) else request.items[start:stop]


def _tokenize(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without the tokenizer's special tokens, in one batched call.

    A fast tokenizer is called through its Rust backend without character offsets, which nothing here reads:
    ids equal the wrapper's, ~25% faster on W1's items. The backend is set up as the wrapper sets it per call.
    """
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    split_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    if backend.encode_special_tokens != split_special_tokens:
        backend.encode_special_tokens = split_special_tokens
    return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]


@dataclass(frozen=True)
class _TemplateIds:
    """A template's token ids that do not depend on the query, for one tokenizer and instruction."""

    bos: list[int]
    separator: list[int]
    suffix: list[int]
    empty_item: list[int]  # the item text with no document: an item's leading tokens that match it are the template's


def _template_ids(tokenizer: Any, template: Template, instruction: str | None) -> _TemplateIds:
    def tokenize() -> _TemplateIds:
        separator, suffix, empty_item = _tokenize(tokenizer, [template.separator, template.suffix(instruction),
                                                              template.item("")])
        bos = tokenizer.bos_token_id
        with_bos = template.add_bos and bos is not None and bos != tokenizer.pad_token_id
        return _TemplateIds([bos] if with_bos else [], separator, suffix, empty_item)

    return _cached(tokenizer, ("template", template, instruction), tokenize)


def _encode_text(request: ScoreRequest, loaded: LoadedModel, template: Template, mode: str,
                 chunk: _Chunk) -> EncodedRequest:
    """A text template: [bos] prefix sep | item | sep suffix; the prefix and the items in one tokenizer call."""
    if not isinstance(request.query, str):
        raise InvalidRequest("query", f"template {template.name!r} needs the query as text, not token ids")
    if request.items_are_token_ids:
        raise InvalidRequest("items", f"template {template.name!r} needs texts, not token ids")
    parts = _template_ids(loaded.tokenizer, template, request.instruction)
    head_ids = _head_ids(loaded.tokenizer, template, request.instruction, request.query)
    if head_ids is None:
        prefix_text = template.prefix(request.instruction, request.query)
    else:  # the instruction's head is known: only the query's line on is tokenized
        prefix_text = template.prefix_parts(request.instruction, request.query)[1]
    (prefix,), items = _tokenize_items(loaded.tokenizer, chunk.items, request, loaded, template.item, [prefix_text])
    if head_ids is not None:
        prefix = head_ids + prefix
    encoded = EncodedRequest(mode, parts.bos + prefix + parts.separator, [], parts.separator + parts.suffix, [],
                             read_first=False, head_len=0 if head_ids is None else len(parts.bos) + len(head_ids))
    _set_items(encoded, items, request, loaded, chunk.offset, lead_ids=parts.empty_item)
    return encoded


def _head_ids(tokenizer: Any, template: Template, instruction: str | None, query: str) -> list[int] | None:
    """The ids of the prefix's head (``Template.prefix_parts``: system prompt and instruction, before the query's
    line), when tokenizing head and tail apart gives the whole prefix's ids; None where it does not, or where the
    head is empty. Checked once per tokenizer, template and instruction, on the first query and on a probe query.

    A long instruction then costs no tokenizing after its first request. The check holds for every query: a
    pre-tokenizer (regex split, whitespace split, metaspace) decides a boundary from the text around it, and the
    text after the head's end up to the query is the template's own (a line break, then ``<Query>: `` or
    ``query: ``), the same in every request. BPE, WordPiece and Unigram never merge across pre-token boundaries.
    """

    def check() -> list[int] | None:
        head, tail = template.prefix_parts(instruction, query)
        if not head:
            return None
        probe = template.prefix_parts(instruction, HEAD_PROBE_QUERY)[1]
        head_ids, *rest = _tokenize(tokenizer, [head, tail, head + tail, probe, head + probe])
        tail_ids, whole, probe_ids, probe_whole = rest
        agrees = head_ids + tail_ids == whole and head_ids + probe_ids == probe_whole
        return head_ids if agrees else None

    return _cached(tokenizer, ("head", template, instruction), check)


def later_item_ids(request: ScoreRequest, loaded: LoadedModel, mode: str, template: Template | None,
                   items: slice) -> list[list[int]]:
    """The token ids of ``request.items[items]`` as a later chunk tokenizes them, before they are fitted: a text
    template's items through ``template.item``, the others as they come. The backend runs this on a worker thread
    while the GPU runs the chunks before (a fast tokenizer releases the GIL), then passes the ids to
    ``encode_request``; an error raised here is the one ``encode_request`` would raise."""
    return _chunk_item_ids(request, loaded, mode, template, _Chunk(request, items))


def _chunk_item_ids(request: ScoreRequest, loaded: LoadedModel, mode: str, template: Template | None,
                    chunk: _Chunk) -> list[list[int]]:
    if _templated_items(mode, template):
        return _tokenize_items(loaded.tokenizer, chunk.items, request, loaded, template.item)[1]
    return _item_ids(request, loaded, chunk)


def _templated_items(mode: str, template: Template | None) -> bool:
    """Whether a request's items are tokenized inside a text template's item."""
    return mode in ("generative", "cross-encoder") and template is not None and template.name != RAW


def _encode_later_chunk(request: ScoreRequest, loaded: LoadedModel, mode: str, template: Template | None,
                        chunk: _Chunk, earlier: EncodedRequest,
                        item_ids: list[list[int]] | None = None) -> EncodedRequest:
    """A later chunk of a request: ``earlier``'s fields, and only this chunk's items tokenized (or ``item_ids``,
    tokenized ahead by ``later_item_ids``) and fitted as every encoder fits them."""
    encoded = dataclasses.replace(earlier, item_ids=[], windows=None, item_lengths=[])
    if item_ids is None:
        item_ids = _chunk_item_ids(request, loaded, mode, template, chunk)
    lead_ids = _template_ids(loaded.tokenizer, template, request.instruction).empty_item \
        if _templated_items(mode, template) else None
    _set_items(encoded, item_ids, request, loaded, chunk.offset, lead_ids=lead_ids)
    return encoded


def _encode_raw(request: ScoreRequest, loaded: LoadedModel, chunk: _Chunk) -> EncodedRequest:
    """vLLM/SGLang raw layout: query ids (special tokens per the request) and item ids (none), concatenated.

    SGLang's multi-item layout ``query<d>item1<d>item2<d>...`` (``mis_delimiter_token_id``) is laid out as the
    pairs ``query + item``: there an item token sees the query and the earlier tokens of its own item, never a
    delimiter, its positions continue the query's, and the label log-probs "at a delimiter" come from the item's
    last token. So the delimiters are neither computed nor masked; they are left out.
    """
    tokenizer = loaded.tokenizer
    if isinstance(request.query, str):
        query = tokenizer(request.query, add_special_tokens=request.add_special_tokens)["input_ids"]
    else:
        query = _query_ids(request, loaded)
    items = _item_ids(request, loaded, chunk)
    if request.mis_delimiter_token_id is not None:
        _check_vocab([request.mis_delimiter_token_id], loaded.vocab_size, "mis_delimiter_token_id")
    prefix, suffix = ([], query) if request.item_first else (query, [])
    encoded = EncodedRequest("generative", prefix, [], suffix, [], read_first=False)
    _set_items(encoded, items, request, loaded, chunk.offset)
    return encoded


def _encode_pair(request: ScoreRequest, loaded: LoadedModel, chunk: _Chunk) -> EncodedRequest:
    """A cross-encoder pair as the tokenizer lays it out: [CLS] query [SEP] item [SEP] and its segment ids."""
    layout = special_layout(loaded.tokenizer, pair=True)
    query = _query_ids(request, loaded)
    items = _item_ids(request, loaded, chunk)
    prefix = layout.before + query + layout.between
    encoded = EncodedRequest("cross-encoder", prefix, [], list(layout.after), [], read_first=not loaded.is_decoder)
    if "token_type_ids" in loaded.tokenizer.model_input_names:
        encoded.prefix_types = layout.before_types + [layout.first_type] * len(query) + layout.between_types
        encoded.item_type = layout.second_type
        encoded.suffix_types = list(layout.after_types)
    _set_items(encoded, items, request, loaded, chunk.offset)
    return encoded


def _encode_single(request: ScoreRequest, loaded: LoadedModel, mode: str, chunk: _Chunk) -> EncodedRequest:
    """Bi-encoder / late interaction: the query and each item as their own sequences, with special tokens."""
    layout = special_layout(loaded.tokenizer, pair=False)
    fixed = len(layout.before) + len(layout.after)
    query = fit(_query_ids(request, loaded), loaded.max_length - fixed, request.truncation, "query")
    encoded = EncodedRequest(mode, list(layout.before), [], list(layout.after), [],
                             read_first=loaded.pooling == "cls", query_ids=layout.before + query + layout.after)
    if "token_type_ids" in loaded.tokenizer.model_input_names:
        encoded.prefix_types = list(layout.before_types)
        encoded.item_type = layout.first_type
        encoded.suffix_types = list(layout.after_types)
    _set_items(encoded, _item_ids(request, loaded, chunk), request, loaded, chunk.offset)
    return encoded


def _query_ids(request: ScoreRequest, loaded: LoadedModel) -> list[int]:
    if isinstance(request.query, str):  # more than the model's length is never kept: a bounded slice does
        return tokenize_bounded(_tokenizing(loaded.tokenizer), [request.query], loaded.max_length,
                                request.truncation)[1][0]
    _check_vocab(request.query, loaded.vocab_size, "query")
    return list(request.query)


def _item_ids(request: ScoreRequest, loaded: LoadedModel, chunk: _Chunk) -> list[list[int]]:
    if request.items_are_token_ids:
        if chunk.offset == 0:  # every item's ids are checked with the first chunk, so that a request split into
            # chunks (ramp-up) refuses the item the whole request would: an id outside the vocabulary goes first
            for index, item in enumerate(request.items):
                _check_vocab(item, loaded.vocab_size, f"items[{index}]")
        return [list(item) for item in chunk.items]
    return _tokenize_items(loaded.tokenizer, chunk.items, request, loaded)[1]


def _tokenize_items(tokenizer: Any, docs: Any, request: ScoreRequest, loaded: LoadedModel,
                    wrap: Callable[[str], str] | None = None,
                    extra: Texts[str] = ()) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of ``extra`` texts and of each document (through ``wrap``, a template's item), in one call.

    A document far longer than the tokens that can be kept (``kept_tokens``) is tokenized from a bounded slice of
    the side that is kept (``lengths.tokenize_bounded``), so a multi-MB text costs what its kept part costs; a slice that yields fewer than
    the kept tokens and a margin (e.g. mostly whitespace) is grown and tokenized again, up to the whole text.
    """
    kept, policy = kept_tokens(request, loaded.max_length)
    return tokenize_bounded(_tokenizing(tokenizer), docs, kept, policy, wrap, extra)


def _tokenizing(tokenizer: Any) -> Callable[[list[str]], list[list[int]]]:
    """``_tokenize`` with ``tokenizer`` bound, for ``lengths``' bounded slices."""
    return lambda texts: _tokenize(tokenizer, texts)


def _set_items(encoded: EncodedRequest, items: list[list[int]], request: ScoreRequest, loaded: LoadedModel,
               offset: int, lead_ids: list[int] | None = None) -> None:
    """``encoded.item_ids`` (and ``windows``): the items fitted after the encoded prefix and suffix; and
    ``item_lengths``, theirs before."""
    encoded.item_lengths = [len(item) for item in items]
    fixed = len(encoded.prefix_ids) + len(encoded.suffix_ids)
    encoded.item_ids, encoded.windows = fit_items(items, request, loaded.max_length, fixed, offset, lead_ids)


def _check_vocab(ids: list[int], vocab_size: int, field: str) -> None:
    if max(ids) >= vocab_size:
        raise InvalidRequest(field, f"token id {max(ids)} is outside the vocabulary [0, {vocab_size})")


def _label_ids(request: ScoreRequest, loaded: LoadedModel, template: Template) -> list[int]:
    """Label token ids: the request's ids, else its label strings, else the template's, each one token."""
    if request.label_token_ids is not None:
        ids = list(request.label_token_ids)
        field = "label_token_ids"
    else:
        labels = request.labels if request.labels is not None else list(template.labels)
        field = "labels"
        if not labels:
            raise InvalidRequest("label_token_ids", "raw scoring needs label_token_ids (or labels)")
        ids = []
        tokenized = _cached(loaded.tokenizer, ("labels", tuple(labels)), lambda: _tokenize(loaded.tokenizer, labels))
        for label, label_ids in zip(labels, tokenized):
            if len(label_ids) != 1:
                raise InvalidRequest(field, f"{label!r} is {len(label_ids)} tokens for this tokenizer; "
                                     "each label must be a single token")
            ids.extend(label_ids)
    _check_vocab(ids, loaded.vocab_size, field)
    if len(set(ids)) != len(ids):
        raise InvalidRequest(field, f"holds the same token twice ({ids})")
    return ids


def _cached(tokenizer: Any, key: tuple, compute: Callable[[], _Value]) -> _Value:
    """``compute()`` once per tokenizer and ``key``; the newest entries of each tokenizer are kept."""
    entries = _CACHE.setdefault(tokenizer, {})
    if key not in entries:
        if len(entries) >= MAX_CACHED_PER_TOKENIZER:
            entries.pop(next(iter(entries)))
        entries[key] = compute()
    return entries[key]
