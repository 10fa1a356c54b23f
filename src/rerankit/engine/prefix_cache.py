"""Keys and values of long prompt heads, kept across calls (prefix caching).

A template's head (BOS, system prompt and instruction: the prefix before the query's line) is the same in every
request that uses the instruction. When it is long, the runner keeps each layer's keys and values of it after the
first forward that needs them, and later micro-batches leave those tokens out: their sequences start after the head
(positions from its length on) and attend to the kept rows first. The scores are those of the whole prefix (the
head's keys do not depend on what follows it in a causal model), up to the rounding of GEMMs of other shapes.

Entries are keyed by the head's token ids and dropped least recently used first past a byte budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# Heads shorter than this are computed with each request: keeping them saves little and costs a separate forward and
# an eager micro-batch. A 1,024-token instruction (benchmarks/pairs.py LI) is ~1,060 head tokens.
PREFIX_CACHE_MIN_TOKENS = 256
# A kept head is cut to a multiple of this many tokens (the Triton attention kernel's widest key tile): its keys are
# then read in whole tiles, and its last few tokens join the batch's own prefix, computed each call with the query's
# line. The Gluon kernel's 128-key tiles mask a partial last tile of kept keys (LI's 1,024 kept keys are 8 whole ones).
KEPT_HEAD_MULTIPLE = 64
# Keys and values of all layers: 112 KiB a token for the Qwen3-0.6B shape (28 layers x 8 heads x 128 x 2 x bf16),
# 144 KiB for the 4B and 8B shapes; 1 GiB holds ~9,000 and ~7,000 tokens.
PREFIX_CACHE_MAX_BYTES = 1 << 30


def kept_length(head_len: int) -> int:
    """Tokens of a head of ``head_len`` tokens that are kept: a multiple of KEPT_HEAD_MULTIPLE, 0 when that leaves
    fewer than PREFIX_CACHE_MIN_TOKENS."""
    kept = head_len - head_len % KEPT_HEAD_MULTIPLE
    return kept if kept >= PREFIX_CACHE_MIN_TOKENS else 0


@dataclass
class CachedKV:
    """One head's keys and values, one [tokens, kv_heads, head_dim] tensor of each per layer."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def tokens(self) -> int:
        return int(self.keys[0].shape[0]) if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (*self.keys, *self.values))


class PrefixCache:
    """Least recently used heads' ``CachedKV``, at most ``max_bytes`` of them. Not thread-safe: the backend's lock
    serialises the model's use."""

    def __init__(self, max_bytes: int = PREFIX_CACHE_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.hits = 0
        self.fills = 0
        self._entries: OrderedDict[bytes, CachedKV] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes the kept entries hold."""
        return sum(entry.nbytes for entry in self._entries.values())

    def get(self, head_ids: np.ndarray, compute: Callable[[np.ndarray], CachedKV]) -> CachedKV:
        """The keys and values of ``head_ids``: kept ones, else ``compute(head_ids)``, kept while they fit."""
        key = np.ascontiguousarray(head_ids, dtype=np.int64).tobytes()
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return entry
        entry = compute(head_ids)
        self.fills += 1
        if entry.nbytes <= self.max_bytes:
            while self._entries and self.nbytes + entry.nbytes > self.max_bytes:
                self._entries.popitem(last=False)
            self._entries[key] = entry
        return entry

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()
