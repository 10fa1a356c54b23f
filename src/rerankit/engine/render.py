"""What a request is scored on, shown: per document the exact sequences (text and token ids), what truncation cut,
and where the score is read. It encodes through ``encode.py``, the engine's one prompt builder, so what it shows is
what the model runs; it needs the tokenizer and config only, not the weights (``rerankit render``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rerankit.engine.encode import EncodedRequest, encode_request
from rerankit.engine.resolve import Defaults, resolve_request
from rerankit.engine.load import LoadedModel
from rerankit.schema import ScoreRequest
from rerankit.templates import RAW, Template


@dataclass
class RenderedSequence:
    """One sequence the model runs: its text (special tokens included), ids, and the position the score is read."""

    text: str
    token_ids: list[int]
    tokens: int
    read_position: int | None  # None: the states are pooled over every token (mean pooling)
    read_token: str | None


@dataclass
class RenderedItem:
    """A document as it is scored: its sequences (several with ``long_documents``) and what truncation cut."""

    index: int
    sequences: list[RenderedSequence]
    document_tokens: int  # the item's tokens before any cut (at least: a long text is tokenized from a bounded slice)
    cut_tokens: int | None  # tokens of the item that truncation dropped; None when it is scored in windows


@dataclass
class Rendering:
    """A whole request as it is scored: mode, template, the labels read, and each item."""

    model: str
    mode: str
    template: str | None
    instruction: str | None
    labels: list[dict[str, Any]]  # [{"token": str, "id": int}], the first the positive one; [] without labels
    query: RenderedSequence | None  # bi-encoder and late interaction: the query's own sequence
    items: list[RenderedItem]

    def to_dict(self) -> dict[str, Any]:
        """As plain JSON-able data."""
        return asdict(self)


def render_request(request: ScoreRequest, loaded: LoadedModel, defaults: Defaults = Defaults()) -> Rendering:
    """Encode ``request`` as the engine does (same checks, same errors) and lay out what is scored."""
    request, mode, template = resolve_request(request, loaded, defaults)
    encoded = encode_request(request, loaded, mode, template)
    tokenizer = loaded.tokenizer
    full = encoded.item_lengths
    items, position = [], 0
    for index, count in enumerate(encoded.item_windows):
        windows = encoded.item_ids[position:position + count]
        position += count
        sequences = [_sequence(encoded, loaded, window) for window in windows]
        cut = max(full[index] - len(windows[0]), 0) if count == 1 else None
        items.append(RenderedItem(index, sequences, full[index], cut))
    labels = [{"token": tokenizer.convert_ids_to_tokens(label), "id": label} for label in encoded.label_ids]
    query = encoded.query_sequence()
    return Rendering(
        model=loaded.name, mode=mode, template=None if template is None else template.name,
        instruction=_instruction(request, template),
        labels=labels, items=items,
        query=None if query is None else _shown(query.input_ids, query.read_offset, loaded),
    )


def _instruction(request: ScoreRequest, template: Template | None) -> str | None:
    """The instruction the prompt holds: the request's (or the backend's), else the template's default."""
    if template is None or template.name == RAW:
        return None
    return request.instruction if request.instruction is not None else template.default_instruction


def _sequence(encoded: EncodedRequest, loaded: LoadedModel, item: list[int]) -> RenderedSequence:
    ids = encoded.prefix_ids + item + encoded.suffix_ids
    return _shown(ids, 0 if encoded.read_first else len(ids) - 1, loaded)


def _shown(ids: list[int], read: int, loaded: LoadedModel) -> RenderedSequence:
    pooled = loaded.kind == "encoder" and loaded.pooling == "mean"
    text = loaded.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return RenderedSequence(text=text, token_ids=ids, tokens=len(ids), read_position=None if pooled else read,
                            read_token=None if pooled else loaded.tokenizer.convert_ids_to_tokens(ids[read]))
