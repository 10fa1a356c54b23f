"""Token estimates without a tokenizer, for budgets and limits decided before the engine sees a request (the
server's scheduler, the data-parallel planner): exact for token ids, about 4 UTF-8 bytes a token for text."""

from __future__ import annotations

from rerankit.schema import ScoreRequest

BYTES_PER_TOKEN = 4  # English text with a BPE or WordPiece vocabulary; only budgets are built on it, never scores


def item_tokens(request: ScoreRequest, cap: int | None = None) -> list[int]:
    """About how many tokens each item's pair feeds the model (exact for token ids), after cutting items to
    the request's ``max_tokens_per_item`` and to ``cap`` (the model's longest input, when known)."""
    def length(part: str | list[int]) -> int:
        return len(part) if isinstance(part, list) else max(1, len(part.encode()) // BYTES_PER_TOKEN)

    limits = [limit for limit in (request.max_tokens_per_item, cap) if limit is not None]
    item_cap = min(limits) if limits else None
    query = length(request.query)
    pairs = [query + (length(item) if item_cap is None else min(item_cap, length(item))) for item in request.items]
    return pairs if cap is None else [min(cap, pair) for pair in pairs]
