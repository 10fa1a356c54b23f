"""Length-sorted micro-batches under a token budget, laid out as ``PackedBatch``es.

Sorting by length keeps the sequences of a batch alike, so a padded runner wastes little on padding; the
budget counts padded tokens (longest x count) for a padded runner and real tokens for a packed one.
"""

from __future__ import annotations

import torch

from rerankit.engine.batch import PackedBatch
from rerankit.engine.encode import Sequence

DEFAULT_MAX_BATCH_TOKENS = 16384


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


def pack(sequences: list[Sequence], *, causal: bool) -> PackedBatch:
    """Sequences end to end as one ``PackedBatch``: one span per sequence, no prefix sharing."""
    lengths = torch.tensor([len(sequence.input_ids) for sequence in sequences], dtype=torch.int64)
    starts = torch.cumsum(lengths, 0) - lengths
    cu_seqlens = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    token_types = None
    if sequences[0].token_type_ids is not None:
        token_types = torch.tensor([t for sequence in sequences for t in sequence.token_type_ids], dtype=torch.int64)
    return PackedBatch(
        input_ids=torch.tensor([t for sequence in sequences for t in sequence.input_ids], dtype=torch.int64),
        position_ids=torch.cat([torch.arange(int(length)) for length in lengths]),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(lengths.max()),
        prefix_lens=torch.zeros(len(sequences), dtype=torch.int32),
        span_starts=torch.repeat_interleave(starts, lengths).to(torch.int32),
        read_positions=starts + torch.tensor([sequence.read_offset for sequence in sequences]),
        item_indices=torch.tensor([sequence.key for sequence in sequences], dtype=torch.int64),
        request_ids=torch.zeros(len(sequences), dtype=torch.int64),
        causal=causal,
        token_type_ids=token_types,
    )


def plan_batches(sequences: list[Sequence], max_batch_tokens: int, *, padded: bool,
                 causal: bool) -> list[PackedBatch]:
    """Sequences grouped by length under ``max_batch_tokens`` and packed, longest batch first."""
    groups = group_by_length([len(sequence.input_ids) for sequence in sequences], max_batch_tokens, padded=padded)
    return [pack([sequences[index] for index in group], causal=causal) for group in groups]
