"""Micro-batches under a token budget, packed without padding, sharing each request's prefix where that is exact.

Sequences lie end to end in a ``PackedBatch``. With prefix sharing (multi-item scoring, MIS) one sequence holds a
request's prefix once, then one span per item (item + suffix); span positions restart where the prefix ends and the
mask of ``batch.py`` lets a span see the prefix and itself only, so every item is computed as if it were alone. A
request whose spans overflow the budget goes on in the next micro-batch with its prefix repeated there. Requests
share micro-batches; the reads of a micro-batch are grouped by head, so each head runs once per micro-batch.

A padded runner pays for padding, so for it the budget counts longest x count over length-sorted groups; for a
packed runner it counts real tokens. Layouts are built with numpy over whole arrays, not per token: planning W1
(100 pairs of ~324 tokens) takes at most a quarter of a millisecond (``benchmarks/plan_host.py``).

``Planner`` takes requests one at a time (or a request in chunks of items) and yields each micro-batch as soon as it
is full, so the backend can run micro-batch k on the GPU while the host still encodes the requests of k+1. A
request's chunks that land in one micro-batch continue the same MIS sequence (one prefix). Pairs that do not share
a prefix are sorted longest first within windows of a few budgets (all of them at once for a padded runner).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from rerankit.engine.batch import PackedBatch
from rerankit.engine.encode import EncodedRequest, Sequence
from rerankit.engine.prefix_cache import kept_length

# Tokens per micro-batch for a packed runner. On an H100 (benchmarks/pairs.py --budgets, Qwen3-0.6B shape, MIS) W1
# ran at 1,028 / 1,239 / 1,377 / 1,429 pairs/s with 8k / 16k / 32k / 64k, 16 W2 queries at 864 / 1,340 / 1,381 /
# 1,169; 32k held 1.3 GiB of activations, 64k 2.5 GiB. Again with CUDA graphs (8k batches then replay in one
# launch): W1 1,575 / 1,346 / 1,574, 16 W2 queries 1,604 / 1,552 / 1,681, LI 1,739 / 1,914 / 2,002 at 8k / 16k / 32k.
DEFAULT_MAX_BATCH_TOKENS = 32768
# Pairs without a shared prefix wait until this many budgets of them are known, then are sorted and packed.
PAIR_WINDOW_BUDGETS = 4


@dataclass
class RequestParts:
    """One request's token ids as the planner packs them, and how its items may be laid out.

    share_prefix: the items follow one copy of the prefix (MIS); the caller decides that this is exact.
    head:         reads are grouped by this key in a micro-batch; requests that score alike share one.
    own_batches:  the head needs every token of its sequences, so no other request shares its micro-batches.
    cached_head:  with share_prefix, the prefix's first tokens, whose keys and values the runner keeps across calls
                  (``engine.prefix_cache``): they are left out of the batch, and ``prefix`` holds the rest.
    """

    prefix: np.ndarray
    items: list[np.ndarray]
    suffix: np.ndarray
    read_first: bool = False
    share_prefix: bool = False
    head: int = 0
    own_batches: bool = False
    prefix_types: np.ndarray | None = None
    item_type: int = 0
    suffix_types: np.ndarray | None = None
    item_offset: int = 0  # index in the request of items[0], when these parts are one chunk of its items
    cached_head: np.ndarray | None = None
    item_lengths: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.item_lengths = np.fromiter((len(item) for item in self.items), dtype=np.int64, count=len(self.items))

    @classmethod
    def from_encoded(cls, encoded: EncodedRequest, cache_head: bool = False, **layout) -> "RequestParts":
        """The parts of an encoded request as int64 arrays; ``layout`` sets share_prefix, head, own_batches.
        ``cache_head``: the prefix's head (``encoded.head_len`` tokens, cut to ``prefix_cache.kept_length``) becomes
        ``cached_head``, where that leaves a head long enough to keep."""
        lengths = [len(item) for item in encoded.item_ids]
        flat = np.fromiter(itertools.chain.from_iterable(encoded.item_ids), dtype=np.int64, count=sum(lengths))
        ends = itertools.accumulate(lengths)  # slices of the flat array (np.split costs ~4x as much host time)
        typed = encoded.prefix_types is not None and encoded.suffix_types is not None
        prefix = np.asarray(encoded.prefix_ids, dtype=np.int64)
        cut = kept_length(encoded.head_len) if cache_head else 0
        return cls(
            prefix=prefix[cut:],
            cached_head=prefix[:cut] if cut else None,
            items=[flat[end - length:end] for end, length in zip(ends, lengths)],
            suffix=np.asarray(encoded.suffix_ids, dtype=np.int64),
            read_first=encoded.read_first,
            prefix_types=np.asarray(encoded.prefix_types, dtype=np.int64) if typed else None,
            item_type=encoded.item_type,
            suffix_types=np.asarray(encoded.suffix_types, dtype=np.int64) if typed else None,
            **layout,
        )

    @property
    def span_lengths(self) -> np.ndarray:
        """Tokens of each item's span after a shared prefix: item + suffix."""
        return self.item_lengths + len(self.suffix)

    def pair_length(self, item: int) -> int:
        """Tokens of item ``item`` scored alone: prefix + item + suffix."""
        return len(self.prefix) + int(self.item_lengths[item]) + len(self.suffix)


@dataclass
class MicroBatch:
    """A packed batch with what the backend needs to run its heads and scatter the results back.

    read_requests / read_items: the request (of the engine call) and item of each read position, in its order.
    head_slices:    (head key, first read, end read) for each run of reads that one head scores.
    request_tokens: tokens this micro-batch runs for each request (shared prefixes counted once).
    """

    batch: PackedBatch
    read_requests: np.ndarray
    read_items: np.ndarray
    head_slices: list[tuple[int, int, int]]
    request_tokens: dict[int, int]


def group_by_length(lengths: list[int], max_batch_tokens: int, *, padded: bool) -> list[list[int]]:
    """Indices of ``lengths`` in micro-batches, longest first; a sequence over the budget gets a batch alone."""
    order = sorted(range(len(lengths)), key=lambda index: -lengths[index])
    groups: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for index in order:
        length = lengths[index]
        # Sorted longest first, so the first member of a group sets its padded width.
        cost = lengths[current[0]] * (len(current) + 1) if padded and current else tokens + length
        if current and cost > max_batch_tokens:
            groups.append(current)
            current, tokens = [], 0
        current.append(index)
        tokens += length
    if current:
        groups.append(current)
    return groups


def plan_requests(requests: list[RequestParts], max_batch_tokens: int, *, padded: bool, causal: bool,
                  pin_memory: bool = False) -> Iterator[MicroBatch]:
    """Every item of every request exactly once, in micro-batches of at most ``max_batch_tokens`` tokens.

    A sequence longer than the budget gets a micro-batch alone. Micro-batches are built as they are consumed, so a
    large call never holds all of them at once. ``pin_memory`` puts the tensors that go to the device in
    page-locked memory, so that the runner's copies are asynchronous. Request ``i`` is ``requests[i]``.
    """
    planner = Planner(max_batch_tokens, padded=padded, causal=causal, pin_memory=pin_memory)
    for index, parts in enumerate(requests):
        yield from planner.add(index, parts)
    yield from planner.finish()


class Planner:
    """Plans requests as they arrive; ``add`` and ``finish`` yield the micro-batches they close.

    ``add(index, parts)`` takes request ``index`` whole, or one chunk of its items (``parts.item_offset``): chunks of
    one request must come in item order, before any other request's parts. ``close`` ends the micro-batch being
    filled early (the backend does so to start the GPU on the first chunk of a call); ``finish`` ends the plan.
    """

    def __init__(self, max_batch_tokens: int, *, padded: bool, causal: bool, pin_memory: bool = False) -> None:
        self._planner = _Planner(max_batch_tokens, padded, causal, pin_memory)
        self._padded = padded
        self._window = PAIR_WINDOW_BUDGETS * max_batch_tokens
        self._pending: list[tuple[int, RequestParts, int]] = []  # pairs waiting to be sorted: (index, parts, item)
        self._pending_tokens = 0

    def add(self, index: int, parts: RequestParts) -> Iterator[MicroBatch]:
        """Plan request ``index`` (or a chunk of it)."""
        planner = self._planner
        units = [(index, parts, item) for item in range(len(parts.items))]
        if parts.own_batches:
            yield from planner.flush()
            yield from planner.add_pairs(units)
            yield from planner.flush()
        elif parts.share_prefix:
            if self._padded:
                raise ValueError("a padded runner cannot share a prefix among items")
            yield from planner.add_shared(index, parts)
        else:
            self._pending += units
            self._pending_tokens += int(parts.span_lengths.sum()) + len(parts.items) * len(parts.prefix)
            if not self._padded and self._pending_tokens >= self._window:
                yield from self._plan_pending()

    def close(self) -> Iterator[MicroBatch]:
        """The micro-batch being filled (waiting pairs included), now, even if it has room left."""
        yield from self._plan_pending()
        yield from self._planner.flush()

    def finish(self) -> Iterator[MicroBatch]:
        """Every micro-batch still open."""
        yield from self.close()

    def _plan_pending(self) -> Iterator[MicroBatch]:
        units, self._pending, self._pending_tokens = self._pending, [], 0
        if units:
            yield from self._planner.add_pairs(units)


def pack(sequences: list[Sequence], *, causal: bool) -> PackedBatch:
    """Whole sequences end to end as one ``PackedBatch`` (one span each), keyed by ``Sequence.key``."""
    builder = _Builder()
    for sequence in sequences:
        types = None if sequence.token_type_ids is None else [np.asarray(sequence.token_type_ids, dtype=np.int64)]
        builder.add_sequence(0, 0, [np.asarray(sequence.input_ids, dtype=np.int64)], types, sequence.read_offset,
                             sequence.key)
    return builder.build(causal, pin_memory=False).batch


_TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32}


def _host_tensors(arrays: list[np.ndarray], dtype: type, pin_memory: bool) -> list[torch.Tensor]:
    """The arrays as views of one host tensor of ``dtype``: with ``pin_memory`` one page-locked block for all of
    them (one pinned allocation per micro-batch and dtype, not one per field).

    The pinned block comes from torch's caching host allocator (``torch.empty(..., pin_memory=True)``) and numpy
    fills it in place. On an H100 host, ``Tensor.pin_memory()`` between tokenizer calls took 3.6 ms a call
    where this takes 0.2 (0.02 alone), and the tokenizer calls after it ran 2.5x slower (12.6 vs 5.1 ms for W1's
    documents); W1's planning took 17.7 ms with it and 9.2 ms unpinned.
    """
    sizes = [len(array) for array in arrays]
    if not pin_memory:
        return list(torch.from_numpy(np.concatenate(arrays).astype(dtype, copy=False)).split(sizes))
    flat = torch.empty(sum(sizes), dtype=_TORCH_DTYPES[dtype], pin_memory=True)
    np.concatenate(arrays, out=flat.numpy(), casting="unsafe")
    return list(flat.split(sizes))


class _Planner:
    """Fills one micro-batch at a time; each method yields the micro-batches it closes."""

    def __init__(self, budget: int, padded: bool, causal: bool, pin_memory: bool) -> None:
        self.budget, self.padded, self.causal, self.pin_memory = budget, padded, causal, pin_memory
        self.builder = _Builder()

    def flush(self) -> Iterator[MicroBatch]:
        if self.builder.tokens:
            yield self.builder.build(self.causal, self.pin_memory)
            self.builder = _Builder()

    def add_pairs(self, units: list[tuple[int, RequestParts, int]]) -> Iterator[MicroBatch]:
        """One sequence per (request index, parts, item), longest first; each micro-batch's pairs are laid out in
        one ``_Builder.add_pairs`` call."""
        lengths = [parts.pair_length(item) for _, parts, item in units]
        if self.padded:
            yield from self.flush()
            for group in group_by_length(lengths, self.budget, padded=True):
                self.builder.add_pairs([units[position] for position in group], [lengths[p] for p in group])
                yield from self.flush()
            return
        group: list[int] = []
        tokens = self.builder.tokens
        for position in sorted(range(len(units)), key=lambda position: -lengths[position]):
            if tokens and tokens + lengths[position] > self.budget:
                self.builder.add_pairs([units[p] for p in group], [lengths[p] for p in group])
                group, tokens = [], 0
                yield from self.flush()
            group.append(position)
            tokens += lengths[position]
        self.builder.add_pairs([units[p] for p in group], [lengths[p] for p in group])

    def add_shared(self, index: int, parts: RequestParts) -> Iterator[MicroBatch]:
        """The request's spans after its prefix, as many per micro-batch as fit, the prefix again in each. A
        micro-batch keeps one cached head: a request with another one starts a new micro-batch."""
        if not self.builder.takes_head(parts.cached_head):
            yield from self.flush()
        spans = parts.span_lengths
        start = 0
        while start < len(spans):
            # A chunk that follows its request's open sequence goes on in it, without another prefix.
            extend = self.builder.continues(index, parts)
            prefix = 0 if extend else len(parts.prefix)
            room = self.budget - self.builder.tokens
            if self.builder.tokens and room < prefix + spans[start]:
                yield from self.flush()
                room, prefix, extend = self.budget, len(parts.prefix), False
            filled = prefix + np.cumsum(spans[start:])
            count = max(1, int(np.searchsorted(filled, room, side="right")))
            self.builder.add_shared(index, parts, np.arange(start, start + count), extend)
            start += count


class _Builder:
    """Collects the sequences of one micro-batch as array pieces; ``build`` lays them out with numpy."""

    def __init__(self) -> None:
        self.tokens = 0
        self.ids: list[np.ndarray] = []
        self.types: list[np.ndarray] = []  # once any piece is typed, as long as ``ids`` (``_typed``)
        self.untyped = 0  # tokens laid out without types before the first typed piece
        self.segment_lengths: list[np.ndarray] = []  # a sequence is segments: a shared prefix, then spans
        self.segment_positions: list[np.ndarray] = []  # the position id of each segment's first token
        self.sequence_lengths: list[int] = []
        self.prefix_lengths: list[int] = []
        self.read_positions: list[np.ndarray] = []
        self.read_items: list[np.ndarray] = []
        self.read_requests: list[np.ndarray] = []
        self.read_heads: list[np.ndarray] = []
        self.request_tokens: dict[int, int] = {}
        self.open_shared: tuple | None = None  # (request index, head, prefix) of the last sequence, when it is MIS
        self.cached_head: np.ndarray | None = None  # the one cached prefix head this micro-batch's sequences use
        self.cached_lens: list[int] = []  # per sequence: 0, or the cached head's length when it begins with it

    def takes_head(self, cached_head: np.ndarray | None) -> bool:
        """Whether a sequence beginning with ``cached_head`` (None: no cached head) can join this micro-batch."""
        return cached_head is None or self.cached_head is None or np.array_equal(cached_head, self.cached_head)

    def continues(self, index: int, parts: RequestParts) -> bool:
        """Whether a chunk of request ``index`` can go on in the last sequence (the same request's MIS sequence)."""
        if self.open_shared is None:
            return False
        open_index, open_head, open_prefix = self.open_shared
        return open_index == index and open_head == parts.head and np.array_equal(open_prefix, parts.prefix)

    def add_pairs(self, units: list[tuple[int, RequestParts, int]], lengths: list[int]) -> None:
        """Pairs (request index, parts, item) of ``lengths`` tokens, each a sequence of its own (prefix, item,
        suffix) read at its first or last token, laid out with whole arrays: per pair only the pieces are listed
        (``benchmarks/plan_host.py``, 2-core CPU: 100 typed pairs 0.57 ms, 0.92 when each pair built its own arrays)."""
        if not units:
            return
        count = len(units)
        sizes = np.asarray(lengths, dtype=np.int64)
        starts = self.tokens + np.cumsum(sizes) - sizes
        fills: dict[int, np.ndarray] = {}  # an item's token types: a slice of one array per type, as long as a pair
        read_offsets, items, requests, heads = [], [], [], []
        for (index, parts, item), length in zip(units, lengths):
            item_ids = parts.items[item]
            self.ids += (parts.prefix, item_ids, parts.suffix)
            if parts.prefix_types is not None:
                fill = fills.get(parts.item_type)
                if fill is None:
                    fill = fills[parts.item_type] = np.full(max(lengths), parts.item_type, dtype=np.int64)
                self._typed((parts.prefix_types, fill[:len(item_ids)], parts.suffix_types), length)
            else:
                self._typed(None, length)
            read_offsets.append(0 if parts.read_first else length - 1)
            items.append(item + parts.item_offset)
            requests.append(index)
            heads.append(parts.head)
            self.request_tokens[index] = self.request_tokens.get(index, 0) + length
        self.segment_lengths.append(sizes)
        self.segment_positions.append(np.zeros(count, dtype=np.int64))
        self.sequence_lengths += lengths
        self.prefix_lengths += [0] * count
        self.cached_lens += [0] * count
        self.read_positions.append(starts + np.asarray(read_offsets, dtype=np.int64))
        self.read_items.append(np.asarray(items, dtype=np.int64))
        self.read_requests.append(np.asarray(requests, dtype=np.int64))
        self.read_heads.append(np.asarray(heads, dtype=np.int64))
        self.tokens += int(sizes.sum())
        self.open_shared = None

    def add_sequence(self, index: int, head: int, pieces: list[np.ndarray], types: list[np.ndarray] | None,
                     read_offset: int, item: int) -> None:
        """One sequence, one span, read at ``read_offset``."""
        length = sum(len(piece) for piece in pieces)
        self.ids += pieces
        self._typed(types, length)
        self._add(index, head, np.array([length]), np.zeros(1, dtype=np.int64), 0, np.array([read_offset]),
                  np.array([item]), 0)

    def add_shared(self, index: int, parts: RequestParts, items: np.ndarray, extend: bool) -> None:
        """One MIS sequence: the prefix, then a span (item + suffix) per item, each read at its last token.

        ``extend`` (the caller checked ``continues``): the spans go on in the last sequence, this request's MIS
        sequence, instead. A cached head (``parts.cached_head``) is not laid out: positions start after it.
        """
        prefix = len(parts.prefix)
        cached = 0 if parts.cached_head is None else len(parts.cached_head)
        if cached:
            self.cached_head = parts.cached_head
        spans = parts.span_lengths[items]
        if not extend:
            self.ids.append(parts.prefix)
        for item in items.tolist():
            self.ids += (parts.items[item], parts.suffix)
        self._typed(None, (0 if extend else prefix) + int(spans.sum()))
        if extend:
            self._extend(index, parts.head, spans, cached + prefix, items + parts.item_offset)
        else:
            self._add(index, parts.head, np.concatenate(([prefix], spans)),
                      np.concatenate(([cached], np.full(len(spans), cached + prefix))), prefix,
                      _span_reads(prefix, spans, prefix), items + parts.item_offset, cached)
        self.open_shared = (index, parts.head, parts.prefix)

    def _extend(self, index: int, head: int, spans: np.ndarray, prefix: int, items: np.ndarray) -> None:
        """More item spans at the end of the last (MIS) sequence; ``prefix``: the position their tokens start at. An
        empty span is read at the last of the sequence's prefix tokens in this batch (``prefix_lengths``)."""
        length = int(spans.sum())
        start = self.tokens - int(self.sequence_lengths[-1])
        self.segment_lengths.append(spans)
        self.segment_positions.append(np.full(len(spans), prefix))
        self.sequence_lengths[-1] += length
        self._reads(index, head, _span_reads(self.tokens, spans, start + self.prefix_lengths[-1]), items)
        self.request_tokens[index] += length
        self.tokens += length

    def _add(self, index: int, head: int, segments: np.ndarray, positions: np.ndarray, prefix_length: int,
             reads: np.ndarray, items: np.ndarray, cached: int) -> None:
        length = int(segments.sum())
        self.segment_lengths.append(segments)
        self.segment_positions.append(positions)
        self.sequence_lengths.append(length)
        self.prefix_lengths.append(prefix_length)
        self.cached_lens.append(cached)
        self._reads(index, head, reads + self.tokens, items)
        self.request_tokens[index] = self.request_tokens.get(index, 0) + length
        self.tokens += length
        self.open_shared = None

    def _typed(self, types: "tuple[np.ndarray, ...] | list[np.ndarray] | None", length: int) -> None:
        """The token types of the next ``length`` tokens laid out: ``types``, or zeros (what a model takes for no
        types) where the batch holds typed pieces too, e.g. a templated cross-encoder request beside a plain pair."""
        if types is None:
            if self.types:
                self.types.append(np.zeros(length, dtype=np.int64))
            else:
                self.untyped += length
            return
        if self.untyped:
            self.types.append(np.zeros(self.untyped, dtype=np.int64))
            self.untyped = 0
        self.types += types

    def _reads(self, index: int, head: int, positions: np.ndarray, items: np.ndarray) -> None:
        self.read_positions.append(positions)
        self.read_items.append(items)
        self.read_requests.append(np.full(len(items), index, dtype=np.int64))
        self.read_heads.append(np.full(len(items), head, dtype=np.int64))

    def _keys_per_query(self, segment_lengths: np.ndarray, causal: bool) -> float:
        """Mean keys a token sees: a causal segment of L tokens whose positions start at p (the prefix it sees: 0 for
        a sequence's first segment, or its cached head; the prefix length for a MIS span) sees L * p + L (L + 1) / 2
        keys in all; a bidirectional sequence of L tokens, L * L."""
        if not causal:
            lengths = np.asarray(self.sequence_lengths, dtype=np.float64)
            return float((lengths * lengths).sum() / self.tokens)
        lengths = segment_lengths.astype(np.float64)
        seen = lengths * np.concatenate(self.segment_positions) + lengths * (lengths + 1) / 2
        return float(seen.sum() / self.tokens)

    def build(self, causal: bool, pin_memory: bool) -> MicroBatch:
        lengths = np.concatenate(self.segment_lengths)
        starts = np.cumsum(lengths) - lengths
        # A token's position counts from its segment's first position; a token sees its own segment from its start
        # (for a sequence's first segment that is the sequence start, so a prefix sees itself causally).
        positions = np.arange(self.tokens) - np.repeat(starts - np.concatenate(self.segment_positions), lengths)
        span_starts = np.repeat(starts, lengths)
        cu_seqlens = np.concatenate(([0], np.cumsum(self.sequence_lengths)))
        heads = np.concatenate(self.read_heads)
        order = np.argsort(heads, kind="stable")
        heads = heads[order]
        bounds = np.flatnonzero(np.diff(heads)) + 1
        first = np.concatenate(([0], bounds)).tolist()
        last = np.concatenate((bounds, [len(heads)])).tolist()
        read_requests = np.concatenate(self.read_requests)[order]
        read_items = np.concatenate(self.read_items).astype(np.int64)[order]

        longs = _host_tensors([np.concatenate(self.ids), positions, np.concatenate(self.read_positions)[order],
                               *([np.concatenate(self.types)] if self.types else [])], np.int64, pin_memory)
        cached = self.cached_head is not None
        ints = _host_tensors([cu_seqlens, np.asarray(self.prefix_lengths), span_starts,
                              *([np.asarray(self.cached_lens)] if cached else [])], np.int32, pin_memory)
        batch = PackedBatch(
            input_ids=longs[0],
            position_ids=longs[1],
            cu_seqlens=ints[0],
            max_seqlen=max(self.sequence_lengths),
            prefix_lens=ints[1],
            span_starts=ints[2],
            read_positions=longs[2],
            causal=causal,
            token_type_ids=longs[3] if self.types else None,
            keys_per_query=self._keys_per_query(lengths, causal),
            cached_head=self.cached_head,
            cached_lens=ints[3] if cached else None,
        )
        slices = [(int(heads[start]), start, end) for start, end in zip(first, last)]
        return MicroBatch(batch, read_requests, read_items, slices, self.request_tokens)


def _span_reads(first: int, spans: np.ndarray, prefix_end: int) -> np.ndarray:
    """Where each span laid out from token ``first`` on is read: at its last token, or, for an empty span (an
    empty item with no suffix: raw scoring), at the prefix's last token (``prefix_end - 1``), which is where the
    pair of the query and an empty item would be read on its own."""
    reads = first + np.cumsum(spans) - 1
    reads[spans == 0] = prefix_end - 1
    return reads

