"""Fitting an item's token ids to the model's length: truncation, long-document windows, and the bounded slice of
a long text that is enough to tokenize. No tokenizer here: ``encode.py`` tokenizes, and passes its tokenizing
function to the functions that slice texts.
"""

from __future__ import annotations

from collections.abc import Sequence as Texts
from typing import Callable

from rerankit.errors import InvalidRequest
from rerankit.schema import ScoreRequest

Tokenize = Callable[[list[str]], list[list[int]]]  # texts -> the token ids of each, without special tokens

# A text is tokenized from a bounded slice when it is longer than (tokens it may keep + TOKEN_MARGIN) x
# CHARS_PER_TOKEN characters: ~2x the characters a token of prose or code takes in BPE and WordPiece vocabularies.
# A slice that still yields too few tokens (runs of whitespace, which WordPiece drops) is grown SLICE_GROWTH-fold.
CHARS_PER_TOKEN = 8
TOKEN_MARGIN = 32
SLICE_GROWTH = 4


def kept_tokens(request: ScoreRequest, max_length: int) -> tuple[int | None, str]:
    """The most tokens of one item that can be scored, before the prompt around it is counted (the template's item
    text may add a few), and the side of the text they are on ("start" for its tail, else its head); None when
    the whole item may be needed (long documents in windows, with no cap).

    Windows start at the document's first kept token: with ``long_document_max_windows`` and no
    ``max_tokens_per_item`` they cover the text's head whatever ``truncation`` says; with ``max_tokens_per_item``
    and ``truncation="start"`` the item is first cut to its last ``max_tokens_per_item`` tokens, all of them kept
    (with "none", refused if it has more).
    """
    per_item = request.max_tokens_per_item
    if request.long_documents == "truncate":
        return min(max_length, per_item or max_length), request.truncation
    if per_item is not None and request.truncation != "end":  # all of the cut item, or enough to refuse it
        return per_item, request.truncation
    if request.long_document_max_windows is None:
        return per_item, request.truncation
    window = min(max_length, request.long_document_window or max_length)
    stride = request.long_document_stride or window
    covered = window + stride * (request.long_document_max_windows - 1)
    return (covered if per_item is None else min(covered, per_item)), "end"


def bounded(text: str, chars: int, policy: str) -> str:
    """``text`` cut to about ``chars`` characters on the side truncation keeps, at a whitespace where one is in the
    slice's outer half: pre-tokenizers split there, so the slice's tokens are the whole text's tokens up to the cut
    (for "start", from the cut on, but for the first word, which encode's token margin keeps clear of the kept ones)."""
    if len(text) <= chars:
        return text
    if policy == "start":
        cut = len(text) - chars
        space = next((position for position in range(cut, cut + chars // 2) if text[position].isspace()), cut - 1)
        return text[space + 1:]  # from a word's start: the whitespace before it would tokenize as its own token
    space = next((position for position in range(chars, chars // 2, -1) if text[position].isspace()), chars)
    return text[:space]


def tokenize_bounded(tokenize: Tokenize, texts: Texts[str], kept: int | None, policy: str,
                     wrap: Callable[[str], str] | None = None,
                     extra: Texts[str] = ()) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of ``extra`` texts and of each of ``texts`` (through ``wrap``), in one ``tokenize`` call; a text
    far longer than ``kept`` tokens (None: all are needed) is tokenized from a bounded slice of the side
    ``policy`` keeps ("start": its tail, else its head). A slice that yields fewer than ``kept`` tokens and a
    margin (e.g. mostly whitespace) is grown and tokenized again, up to the whole text."""
    wrap = wrap or (lambda text: text)
    need = None if kept is None else kept + TOKEN_MARGIN
    sliced = [text if need is None else bounded(text, need * CHARS_PER_TOKEN, policy) for text in texts]
    ids = tokenize([*extra, *map(wrap, sliced)])
    lead, items = ids[:len(extra)], ids[len(extra):]
    for index, text in enumerate(texts):
        chars = None if need is None else need * CHARS_PER_TOKEN
        while need is not None and len(sliced[index]) < len(text) and len(items[index]) < need:
            chars *= SLICE_GROWTH
            sliced[index] = bounded(text, chars, policy)
            items[index] = tokenize([wrap(sliced[index])])[0]
    return lead, items


def refuse_huge_texts(request: ScoreRequest, max_length: int, mode: str, tokenize: Tokenize) -> None:
    """Refuse a query or instruction text that cannot fit the model, from a bounded slice of it: the prompt around
    every item holds it whole, so without this a multi-MB query would be tokenized whole before being refused.
    A bi-encoder's query is a sequence of its own, cut like an item (``encode._query_ids``)."""
    fields = ("instruction",) if mode in ("bi-encoder", "late-interaction") else ("query", "instruction")
    for field in fields:
        text = getattr(request, field)
        if isinstance(text, str) and len(text) > (max_length + TOKEN_MARGIN) * CHARS_PER_TOKEN:
            if len(tokenize_bounded(tokenize, [text], max_length, "end")[1][0]) > max_length:
                raise InvalidRequest(field, f"has more than {max_length} tokens, the model's limit for a whole "
                                            "sequence")


def fit_items(items: list[list[int]], request: ScoreRequest, max_length: int, fixed: int, offset: int = 0,
              lead_ids: list[int] | None = None) -> tuple[list[list[int]], list[int] | None]:
    """Cut each item to what the model length (and ``max_tokens_per_item``) leaves after prefix and suffix, or with
    ``long_documents`` split one that does not fit into windows; returns the sequences' items and, when any item
    was split, how many windows each item has.

    ``lead_ids``: the template's item text without a document (e.g. ``<Document>: ``); an item's tokens that match
    it are the template's, not the document's: ``max_tokens_per_item`` counts the document's tokens only, a cut
    never removes them, and every window starts with them.
    """
    room = max_length - fixed
    if room < 1:
        raise InvalidRequest("query", f"the prompt around each item takes {fixed} tokens, which leaves no room for "
                             f"an item within the model's limit of {max_length} tokens")
    per_item = request.max_tokens_per_item
    windowed = request.long_documents != "truncate"
    fitted: list[list[int]] = []
    windows: list[int] = []
    for index, item in enumerate(items, offset):
        if len(item) <= (room if per_item is None else min(room, per_item)) and not (
                windowed and request.long_document_window is not None):
            fitted.append(item)  # fits even counting the template's tokens: no need to find them
            windows.append(1)
            continue
        lead = common_prefix(item, lead_ids) if lead_ids else 0
        field = f"items[{index}]"
        if not windowed:
            limit = room if per_item is None else min(room, lead + per_item)
            fitted.append(fit(item, limit, request.truncation, field, lead))
            windows.append(1)
            continue
        if per_item is not None:
            item = fit(item, lead + per_item, request.truncation, field, lead)
        split = split_windows(item, lead, room, request, field)
        fitted.extend(split)
        windows.append(len(split))
    return fitted, (windows if len(fitted) != len(windows) else None)


def split_windows(item: list[int], lead: int, room: int, request: ScoreRequest, field: str) -> list[list[int]]:
    """``item`` as windows of ``long_document_window`` document tokens (at most what ``room`` leaves), each led by
    the item's ``lead`` template tokens, starting every ``long_document_stride`` tokens until one reaches the end."""
    size = min(room - lead, request.long_document_window or room)
    if size < 1:
        raise InvalidRequest(field, f"the prompt leaves {room} tokens for an item, which its template's {lead} "
                                    "tokens fill: no room for a window")
    head, document = item[:lead], item[lead:]
    if len(document) <= size:  # one window: the stride plays no part (as for an item that fits the model)
        return [item]
    stride = request.long_document_stride or max(1, size * 3 // 4)
    if stride > size:
        raise InvalidRequest("long_document_stride", f"is {stride} tokens, more than the window of {size}: tokens "
                                                     "between windows would not be scored")
    starts = [0]
    while starts[-1] + size < len(document) and len(starts) < (request.long_document_max_windows or len(document)):
        starts.append(starts[-1] + stride)
    return [head + document[start:start + size] for start in starts]


def fit(ids: list[int], limit: int, policy: str, field: str, lead: int = 0) -> list[int]:
    """``ids`` cut to ``limit`` tokens at the end, or at the start keeping its ``lead`` template tokens."""
    if len(ids) <= limit:
        return ids
    if policy == "none" or limit <= lead:
        # "at least": a long text is tokenized from a bounded slice (``tokenize_bounded``)
        raise InvalidRequest(field, f"has at least {len(ids) - lead} tokens; the limit is {max(limit - lead, 0)} "
                             f"(truncation={policy!r})")
    if policy == "end":
        return ids[:limit]
    return ids[:lead] + ids[len(ids) - (limit - lead):]


def common_prefix(ids: list[int], other: list[int]) -> int:
    """How many leading ids ``ids`` and ``other`` share (an item's tokens that are its template's lead)."""
    count = 0
    for left, right in zip(ids, other):
        if left != right:
            break
        count += 1
    return count
