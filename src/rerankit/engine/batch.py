"""The packed micro-batch: what the planner produces and the model runner consumes.

Tokens of several sequences lie end to end with no padding. Each sequence is either one
(prefix + item + suffix) pair, or, under multi-item scoring (MIS), one shared prefix followed by
several item spans (item + suffix). A token of an item span attends to the sequence's prefix and
to the earlier tokens of its own span only; a prefix token attends causally within the prefix.
With ``prefix_lens`` all zero and every ``span_starts`` equal to its sequence start, the mask is
plain causal attention within each sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PackedBatch:
    """One micro-batch of packed sequences, all tensors on the model's device.

    input_ids:     [T] int64 token ids, sequences end to end.
    position_ids:  [T] int64 rotary/absolute positions; MIS item spans restart at the prefix length.
    cu_seqlens:    [B+1] int32 cumulative sequence lengths (sequence b is tokens cu[b]:cu[b+1]).
    max_seqlen:    longest sequence in the batch (int, on the host).
    prefix_lens:   [B] int32 shared-prefix length of each sequence (0 when MIS is off).
    span_starts:   [T] int32 packed index where each token's own span starts (prefix tokens and
                   non-MIS tokens: their sequence start).
    read_positions:[N] int64 packed indices whose hidden state is scored (one per item); which request and item
                   each belongs to stays on the host (``MicroBatch.read_requests`` / ``read_items``).
    causal:        True for decoders; False for bidirectional encoders (MIS is never used there).
    token_type_ids:[T] int64 segment ids for BERT-style pair encoders, else None.
    keys_per_query: mean number of keys a token attends to under the mask (on the host; 0 when not known): the
                   attention kernel picks its tiles by it (``rerankit.kernels.attention_config.default_config``).
    cached_head:   [C] int64 ids (on the host) of a prefix head whose keys and values the runner keeps from an
                   earlier forward (``engine.prefix_cache``), or None. Sequences with ``cached_lens[b] = C`` begin
                   with that head: its tokens are not in the batch, their positions start at C, and they attend to
                   the kept keys before their own.
    cached_lens:   [B] int32 cached head tokens before each sequence (C or 0); None when ``cached_head`` is None.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    prefix_lens: torch.Tensor
    span_starts: torch.Tensor
    read_positions: torch.Tensor
    causal: bool = True
    token_type_ids: torch.Tensor | None = None
    keys_per_query: float = 0.0
    cached_head: np.ndarray | None = None
    cached_lens: torch.Tensor | None = None

    @property
    def cached_len(self) -> int:
        """Tokens of the cached head these sequences may begin with (0 without one)."""
        return 0 if self.cached_head is None else len(self.cached_head)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def is_multi_item(self) -> bool:
        """True when some sequence shares a prefix among several item spans."""
        return bool(self.prefix_lens.numel()) and bool((self.prefix_lens > 0).any())

    def to(self, device: torch.device | str) -> "PackedBatch":
        """The same batch with every tensor moved to ``device``."""
        moved = {
            name: (value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value)
            for name, value in self.__dict__.items()
        }
        return PackedBatch(**moved)


def attention_allowed(batch: PackedBatch) -> torch.Tensor:
    """Dense [T, T] boolean mask of which key each query may see: the slow, obvious reference."""
    total = batch.num_tokens
    device = batch.input_ids.device
    cu = batch.cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    seq_start = cu[:-1][seq_of_token]
    prefix_end = seq_start + batch.prefix_lens.to(torch.int64)[seq_of_token]
    span_start = batch.span_starts.to(torch.int64)
    q = torch.arange(total, device=device)[:, None]
    k = torch.arange(total, device=device)[None, :]
    same_seq = seq_of_token[:, None] == seq_of_token[None, :]
    if not batch.causal:
        return same_seq
    visible = (k < prefix_end[:, None]) | (k >= span_start[:, None])
    return same_seq & (k <= q) & visible
