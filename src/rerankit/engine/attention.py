"""Packed attention for the model runner: one call per layer over a :class:`PackedBatch`.

Backends (all compute the mask of :func:`rerankit.engine.batch.attention_allowed`):
  triton  our shared-prefix kernel (rerankit.kernels.prefix_attention); CUDA, or CPU under TRITON_INTERPRET=1
  flex    torch FlexAttention with a BlockMask built once per batch; compiled on CUDA, eager on CPU
  varlen  torch.nn.attention.varlen.varlen_attn (flash attention); CUDA, plain packed attention only (no MIS)
  sdpa    torch SDPA over spans: the CPU default. Every span (a MIS prefix, an item span, a whole plain sequence)
          attends to its sequence's prefix keys and its own keys only, and spans of about one length run as one
          padded call, so no [L, L] mask over a whole MIS sequence is ever built
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import triton
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from rerankit.engine.batch import PackedBatch
from rerankit.kernels.prefix_attention import prefix_attention

BACKENDS = ("triton", "flex", "varlen", "sdpa")
# The sdpa backend pads the spans of one call to the longest: a span joins a call while it is at least this
# fraction of the call's longest span, and a call gathers at most MAX_SPAN_KEYS key rows (span copies of the prefix).
SPAN_LENGTH_RATIO = 0.75
MAX_SPAN_KEYS = 1 << 16


def available_backends(device: torch.device | str) -> list[str]:
    """The backends that can run on ``device`` in this process."""
    on_cuda = torch.device(device).type == "cuda"
    found = ["sdpa", "flex"]
    if on_cuda or triton.knobs.runtime.interpret:
        found.append("triton")
    if on_cuda and _varlen_attn() is not None:
        found.append("varlen")
    return found


def default_backend(device: torch.device | str) -> str:
    """Triton on CUDA (fastest in benchmarks/attention.py on an H100, MIS or not); SDPA elsewhere."""
    return "triton" if torch.device(device).type == "cuda" else "sdpa"


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: PackedBatch,
    scale: float | None = None,
    backend: str | None = None,
    cached: tuple[torch.Tensor, torch.Tensor] | None = None,
    reads: torch.Tensor | None = None,
    fp8_bound: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [T, Hq, D] over k/v [T, Hkv, D] under the batch's packed (and MIS) mask -> [T, Hq, D].

    ``cached`` = (k, v) [C, Hkv, D]: keys and values of a prefix head kept from an earlier forward; sequence b sees
    their first ``batch.cached_lens[b]`` rows before its own keys (triton and sdpa backends only).
    ``reads`` [R]: only those tokens' rows, [R, Hq, D]; the triton backend computes only them, the others compute
    every row and keep those.
    ``fp8_bound`` [1] (the largest |v|): float8 codes and one scale a row instead (``prefix_attention``'s); the
    triton backend writes them from its own tiles, the others quantize their output in a pass.
    """
    backend = backend or default_backend(q.device)
    if fp8_bound is not None and backend != "triton":
        from rerankit.kernels.fp8_quant import quantize_bounded

        out = packed_attention(q, k, v, batch, scale, backend, cached, reads)
        codes, scales = quantize_bounded(out.flatten(1), fp8_bound)
        return codes.view(out.shape), scales
    if cached is not None and backend not in ("triton", "sdpa"):
        raise ValueError(f"the {backend} backend cannot attend to cached prefix keys; use 'triton' or 'sdpa'")
    if backend == "triton":
        return prefix_attention(q, k, v, batch.cu_seqlens, batch.max_seqlen, batch.prefix_lens,
                                batch.span_starts, batch.causal, scale, keys_per_query=batch.keys_per_query,
                                cached=None if cached is None else (batch.cached_lens, *cached), reads=reads,
                                fp8_bound=fp8_bound)
    if reads is not None:
        return packed_attention(q, k, v, batch, scale, backend, cached)[reads]
    if backend == "sdpa":
        if cached is not None:  # the cached rows first: the span groups index keys from there on
            k, v = (torch.cat([kept[:batch.cached_len], own]) for kept, own in zip(cached, (k, v)))
        return _sdpa(q, k, v, batch, scale)
    if backend == "flex":
        return _flex(q, k, v, batch, scale)
    if backend == "varlen":
        return _varlen(q, k, v, batch, scale)
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")


@dataclass
class _SpanGroup:
    """Spans of about one length, padded to the longest, that one SDPA call attends.

    queries: [n, L] packed index of each query row; a padding row repeats its span's last token.
    keys:    [n, S] packed index of each key: the span's prefix (padded to the group's longest), then the span.
    mask:    which keys each row sees, broadcastable to [n, 1, L, S]; None when plain causal (or full) attention
             over the group's padded spans is exact: no prefix, and padding rows only ever follow real ones.
    rows / targets: the real rows of the flattened [n * L] output, and the packed index each one goes to.
    """

    queries: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor | None
    rows: torch.Tensor
    targets: torch.Tensor


@dataclass
class _BatchState:
    """What a backend derives from a batch once and reuses in every layer."""

    multi_item: bool
    block_mask: BlockMask | None = None
    span_groups: list[_SpanGroup] | None = None


# A forward pass calls every layer with the same batch object; a few live entries cover the
# batches in flight across threads. Keyed by id() with a weakref check, since PackedBatch is unhashable.
_STATES: dict[int, tuple[weakref.ref, _BatchState]] = {}
_STATES_LOCK = threading.Lock()
_MAX_STATES = 8


def _batch_state(batch: PackedBatch) -> _BatchState:
    with _STATES_LOCK:
        entry = _STATES.get(id(batch))
        if entry is not None and entry[0]() is batch:
            return entry[1]
        state = _BatchState(multi_item=batch.is_multi_item)
        for key in [key for key, (ref, _) in _STATES.items() if ref() is None]:
            del _STATES[key]  # a batch that is gone: its masks (large on the CPU) go with it
        while len(_STATES) >= _MAX_STATES:
            _STATES.pop(next(iter(_STATES)))
        _STATES[id(batch)] = (weakref.ref(batch), state)
        return state


def _sdpa(q, k, v, batch, scale):
    state = _batch_state(batch)
    if state.span_groups is None:
        state.span_groups = span_groups(batch)
    out = torch.empty_like(q)
    for group in state.span_groups:
        heads_first = [x[index].transpose(1, 2) for x, index in ((q, group.queries), (k, group.keys), (v, group.keys))]
        attended = F.scaled_dot_product_attention(*heads_first, attn_mask=group.mask,
                                                  is_causal=group.mask is None and batch.causal, scale=scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])
        out[group.targets] = attended.transpose(1, 2).flatten(0, 1)[group.rows]
    return out


def span_groups(batch: PackedBatch) -> list[_SpanGroup]:
    """The batch's spans in padded groups for the sdpa backend, with the index and mask tensors of each group.

    A span is a run of tokens with one ``span_starts``: a MIS prefix (it sees itself causally), an item span (it
    sees its sequence's prefix and itself causally), or a whole plain sequence. A group holds spans with a prefix
    or spans without, longest first, each at least ``SPAN_LENGTH_RATIO`` of the group's longest. With cached prefix
    keys (``batch.cached_lens``) the keys are indexed in the cached rows followed by the batch's own: a span of a
    sequence with a cached head sees those rows first.
    """
    cu = batch.cu_seqlens.cpu().numpy().astype(np.int64)
    total = batch.num_tokens
    cached = np.zeros(len(cu) - 1, dtype=np.int64) if batch.cached_lens is None else \
        batch.cached_lens.cpu().numpy().astype(np.int64)
    offset = batch.cached_len  # the cached rows sit before the batch's keys
    if batch.causal:
        starts = np.flatnonzero(batch.span_starts.cpu().numpy() == np.arange(total))
        sequence = np.searchsorted(cu, starts, side="right") - 1
        prefixes = np.where(starts == cu[sequence], 0, batch.prefix_lens.cpu().numpy()[sequence])
    else:  # an encoder sequence sees itself whole; MIS is never planned for encoders
        starts = cu[:-1][cu[1:] > cu[:-1]]
        sequence = np.searchsorted(cu, starts, side="right") - 1
        prefixes = np.zeros(len(starts), dtype=np.int64)
    heads = cached[sequence]
    prefixes = prefixes + heads
    lengths = np.diff(np.append(starts, total))
    order = np.lexsort((-lengths, prefixes > 0))
    groups: list[_SpanGroup] = []
    members: list[int] = []
    widest = 0

    def close() -> None:
        picked = np.asarray(members)
        groups.append(_span_group(starts[picked], lengths[picked], cu[sequence[picked]], prefixes[picked],
                                  heads[picked], offset, batch.causal, batch.input_ids.device))

    for span in order.tolist():
        if members:
            head = members[0]
            fits = ((prefixes[span] > 0) == (prefixes[head] > 0)
                    and lengths[span] >= SPAN_LENGTH_RATIO * lengths[head]
                    and (len(members) + 1) * (max(widest, prefixes[span]) + lengths[head]) <= MAX_SPAN_KEYS)
            if not fits:
                close()
                members, widest = [], 0
        members.append(span)
        widest = max(widest, int(prefixes[span]))
    if members:
        close()
    return groups


def _span_group(starts: np.ndarray, lengths: np.ndarray, sequence_starts: np.ndarray, prefixes: np.ndarray,
                heads: np.ndarray, offset: int, causal: bool, device: torch.device) -> _SpanGroup:
    """``prefixes``: keys each span sees before its own, the first ``heads`` of them cached rows (indices from 0),
    the rest its sequence's prefix in the batch (indices from ``offset``, where the batch's keys begin)."""
    longest, widest = int(lengths.max()), int(prefixes.max())
    offsets = np.arange(longest)
    queries = starts[:, None] + np.minimum(offsets, lengths[:, None] - 1)
    real = offsets < lengths[:, None]
    mask = None
    if widest:
        prefix_offsets = np.arange(widest)
        clipped = np.minimum(prefix_offsets, prefixes[:, None] - 1)  # padding repeats a span's last prefix key
        prefix_keys = np.where(clipped < heads[:, None], clipped,
                               offset + sequence_starts[:, None] + clipped - heads[:, None])
        keys = np.concatenate([prefix_keys, offset + queries], axis=1)
        sees_prefix = np.broadcast_to((prefix_offsets < prefixes[:, None])[:, None, :], (len(starts), longest, widest))
        # Only causal sequences have a prefix; a real row's own keys are then real ones.
        sees_span = np.broadcast_to(np.tril(np.ones((longest, longest), dtype=bool)), (len(starts), longest, longest))
        mask = np.concatenate([sees_prefix, sees_span], axis=2)[:, None]
    else:
        keys = offset + queries
        if not causal and not real.all():
            mask = real[:, None, None, :]
    rows = np.flatnonzero(real.ravel())

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    return _SpanGroup(tensor(queries), tensor(keys), None if mask is None else tensor(mask), tensor(rows),
                      tensor(queries.ravel()[rows]))


def build_block_mask(batch: PackedBatch) -> BlockMask:
    """FlexAttention BlockMask of the batch's mask (same rule as ``attention_allowed``)."""
    cu = batch.cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    prefix_end = cu[:-1][seq_of_token] + batch.prefix_lens.to(torch.int64)[seq_of_token]
    span_start = batch.span_starts.to(torch.int64)

    def same_sequence(b, h, q_idx, kv_idx):
        return seq_of_token[q_idx] == seq_of_token[kv_idx]

    def shared_prefix_causal(b, h, q_idx, kv_idx):
        visible = (kv_idx < prefix_end[q_idx]) | (kv_idx >= span_start[q_idx])
        return same_sequence(b, h, q_idx, kv_idx) & (kv_idx <= q_idx) & visible

    mask_mod = shared_prefix_causal if batch.causal else same_sequence
    total = batch.num_tokens
    return create_block_mask(mask_mod, None, None, total, total, device=cu.device, _compile=cu.is_cuda)


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention)


def _flex(q, k, v, batch, scale):
    state = _batch_state(batch)
    if state.block_mask is None:
        state.block_mask = build_block_mask(batch)
    # Eager flex on CPU materializes the scores, fine for tests; compiling there costs ~20 s.
    attend = _compiled_flex_attention() if q.is_cuda else flex_attention
    heads_first = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
    out = attend(*heads_first, block_mask=state.block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


@functools.cache
def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen(q, k, v, batch, scale):
    if _batch_state(batch).multi_item:
        raise ValueError("the varlen backend has no shared-prefix mask; use 'triton' or 'flex' for MIS batches")
    varlen_attn = _varlen_attn()
    params = inspect.signature(varlen_attn).parameters
    # torch 2.10 took is_causal; 2.11 replaced it with a (left, right) window, (-1, 0) being causal.
    if "window_size" in params:
        options = {"window_size": (-1, 0) if batch.causal else (-1, -1)}
    else:
        options = {"is_causal": batch.causal}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:  # absent in torch 2.11: there the heads are repeated
            options["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    cu = batch.cu_seqlens.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, batch.max_seqlen, batch.max_seqlen, scale=scale, **options)
