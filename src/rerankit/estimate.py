"""Token estimates without a tokenizer, for budgets and limits decided before the engine sees a request (the
server's scheduler, the data-parallel planner): exact for token ids, about 4 UTF-8 bytes a token for text."""

from __future__ import annotations

import math

from rerankit.schema import ScoreRequest

BYTES_PER_TOKEN = 4  # English text with a BPE or WordPiece vocabulary; only budgets are built on it, never scores


def item_tokens(request: ScoreRequest, cap: int | None = None) -> list[int]:
    """About how many tokens each item's pair feeds the model (exact for token ids), after cutting items to
    the request's ``max_tokens_per_item`` and to ``cap`` (the model's longest input, when known); with
    ``long_documents`` an item too long for one pair counts every window it is scored in."""
    def length(part: str | list[int]) -> int:
        return len(part) if isinstance(part, list) else max(1, len(part.encode()) // BYTES_PER_TOKEN)

    query = length(request.query)
    if request.long_documents != "truncate":
        return [_windowed(query, length(item), request, cap) for item in request.items]
    limits = [limit for limit in (request.max_tokens_per_item, cap) if limit is not None]
    item_cap = min(limits) if limits else None
    pairs = [query + (length(item) if item_cap is None else min(item_cap, length(item))) for item in request.items]
    return pairs if cap is None else [min(cap, pair) for pair in pairs]


def _windowed(query: int, item: int, request: ScoreRequest, cap: int | None) -> int:
    """The tokens of an item's windows, each with the query (``engine.lengths.split_windows``' layout): one pair
    where it fits; the item whole where the model's length is unknown."""
    if request.max_tokens_per_item is not None:
        item = min(item, request.max_tokens_per_item)
    room = None if cap is None else cap - query
    if room is None or room < 1:
        return query + item
    size = min(room, request.long_document_window or room)
    if item <= size:
        return query + item
    stride = request.long_document_stride or max(1, size * 3 // 4)
    windows = 1 + math.ceil((item - size) / stride)
    if request.long_document_max_windows is not None:
        windows = min(windows, request.long_document_max_windows)
    return windows * (query + size)
