"""Label log-probabilities at the read positions, without a [tokens x vocab] logits tensor.

`label_logprobs` scores each read position against its label tokens. Labels-only mode touches just the K label
rows of the lm_head and normalises over the valid labels; full-vocab mode also tiles the whole vocabulary, fusing
`hidden @ W_tile.T` with an online logsumexp so the [N, V] logits never reach memory. The Triton kernels run on
CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1; anything else falls back to `label_logprobs_reference`.
"""

import os
from typing import NamedTuple

import torch
from torch import Tensor

from rerankit.kernels import sm_count
from rerankit.kernels.direct_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still serves machines without triton
    triton = None

# Triton decides at decoration time whether a kernel is interpreted, so read the flag at the same moment.
_INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def label_logprobs_reference(
    hidden: Tensor,
    lm_head_weight: Tensor,
    label_ids: Tensor,
    label_mask: Tensor | None = None,
    full_vocab: bool = False,
    lm_head_bias: Tensor | None = None,
) -> Tensor:
    """Plain-torch `label_logprobs`: full float32 logits, log-softmax, gather. Masked label slots are -inf."""
    if label_mask is None:
        label_mask = torch.ones_like(label_ids, dtype=torch.bool)
    logits = hidden.float() @ lm_head_weight.float().T
    if lm_head_bias is not None:
        logits = logits + lm_head_bias.float()
    label_logits = logits.gather(1, label_ids.masked_fill(~label_mask, 0))
    if full_vocab:
        logprobs = label_logits - logits.logsumexp(-1, keepdim=True)
    else:
        logprobs = label_logits.masked_fill(~label_mask, float("-inf")).log_softmax(-1)
    return logprobs.masked_fill(~label_mask, float("-inf"))


def label_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    label_ids: Tensor,
    label_mask: Tensor | None = None,
    full_vocab: bool = False,
    lm_head_bias: Tensor | None = None,
) -> Tensor:
    """Float32 [N, K] log-probabilities of `label_ids` given `hidden` [N, d] and the lm_head [V, d].

    full_vocab=False normalises over each row's valid labels; full_vocab=True over the whole vocabulary.
    Padding slots (label_mask False) may hold any id and come back as -inf; valid ids must lie in [0, V).
    """
    if triton is None or not (hidden.is_cuda or _INTERPRET):
        return label_logprobs_reference(hidden, lm_head_weight, label_ids, label_mask, full_vocab, lm_head_bias)
    n_rows, n_labels = label_ids.shape
    out = torch.empty(n_rows, n_labels, dtype=torch.float32, device=hidden.device)
    if out.numel() == 0:
        return out
    # One operand dtype for tl.dot; hidden is the small side, so it is the one converted.
    hidden = hidden.to(lm_head_weight.dtype)
    label_ids = label_ids.contiguous()
    if label_mask is None:
        label_mask = torch.ones_like(label_ids, dtype=torch.bool)
    label_mask = label_mask.contiguous()
    bias = lm_head_bias if lm_head_bias is not None else out  # any pointer; unread when HAS_BIAS is False
    if full_vocab:
        partial_lse = _vocab_partial_logsumexp(hidden, lm_head_weight, lm_head_bias, _vocab_tiling(hidden))
    else:
        partial_lse = out  # unread when FULL_VOCAB is False
    block_k = triton.next_power_of_2(n_labels)
    launch(
        _label_logprobs_kernel, (n_rows,), hidden, lm_head_weight, bias, label_ids, label_mask, partial_lse, out,
        hidden.shape[1], partial_lse.shape[0] if full_vocab else 1,
        hidden.stride(0), hidden.stride(1), lm_head_weight.stride(0), lm_head_weight.stride(1),
        n_labels, n_rows,
        HAS_BIAS=lm_head_bias is not None,
        FULL_VOCAB=full_vocab,
        BLOCK_K=block_k,
        BLOCK_D=min(triton.next_power_of_2(hidden.shape[1]), max(32, 8192 // block_k)),
        BLOCK_S=triton.next_power_of_2(partial_lse.shape[0]) if full_vocab else 1,
    )
    return out


class _VocabTiling(NamedTuple):
    """Launch shape of the full-vocabulary kernel: tile sizes, warps, pipeline stages, and the programs per SM
    that the vocabulary splits aim for."""

    block_n: int
    block_v: int
    block_d: int
    num_warps: int
    num_stages: int
    programs_per_sm: int


def _vocab_tiling(hidden: Tensor) -> _VocabTiling:
    """Tiles for the full-vocabulary pass, the fastest of `benchmarks/label_logprobs.py --sweep` on an H100.

    Up to 64 rows the pass streams W once (memory bound; many splits keep every SM loading); beyond, it is a
    matmul, and wide vocabulary tiles with few splits run fastest.
    """
    n_rows = hidden.shape[0]
    block_d = 64 if hidden.element_size() == 2 else 32  # keeps fp32 pipeline stages within shared memory
    if n_rows <= 16:
        return _VocabTiling(16, 64, 2 * block_d, 4, 4, 8)
    if n_rows <= 64:
        return _VocabTiling(64, 128, 2 * block_d, 4, 3, 4)
    return _VocabTiling(128, 256, block_d, 8, 3, 4)


def _vocab_partial_logsumexp(hidden: Tensor, weight: Tensor, bias: Tensor | None, tiling: _VocabTiling) -> Tensor:
    """Logsumexp of each row's logits over each vocabulary split: float32 [num_splits, N]."""
    n_rows, dim = hidden.shape
    vocab = weight.shape[0]
    row_blocks = triton.cdiv(n_rows, tiling.block_n)
    vocab_tiles = triton.cdiv(vocab, tiling.block_v)
    # Split the vocabulary until every SM has work even for one row; recount so that no split is empty.
    sms = sm_count(hidden.device, interpreted=2)
    wanted_splits = min(vocab_tiles, triton.cdiv(tiling.programs_per_sm * sms, row_blocks))
    tiles_per_split = triton.cdiv(vocab_tiles, wanted_splits)
    num_splits = triton.cdiv(vocab_tiles, tiles_per_split)
    partial_lse = torch.empty(num_splits, n_rows, dtype=torch.float32, device=hidden.device)
    launch(
        _vocab_partial_logsumexp_kernel, (row_blocks, num_splits),
        hidden, weight, bias if bias is not None else partial_lse, partial_lse,
        n_rows, vocab, dim, tiles_per_split * tiling.block_v,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
        # Triton's interpreter multiplies bfloat16 blocks as their raw uint16 bits, so it gets float32 blocks.
        DOT_IN_FP32=_INTERPRET and hidden.dtype == torch.bfloat16,
        BLOCK_N=tiling.block_n,
        BLOCK_V=tiling.block_v,
        BLOCK_D=tiling.block_d,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )
    return partial_lse


if triton is not None:

    @triton.jit
    def _vocab_partial_logsumexp_kernel(
        hidden_ptr, weight_ptr, bias_ptr, partial_lse_ptr,
        n_rows, vocab, dim, split_len,
        stride_hn, stride_hd, stride_wv, stride_wd,
        HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One row block x one vocabulary split: tiles of h @ W.T folded into a running max and sum of exps."""
        row_block = tl.program_id(0)
        split = tl.program_id(1)
        rows = row_block * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n_rows
        h_rows = hidden_ptr + rows.to(tl.int64)[:, None] * stride_hn
        running_max = tl.full([BLOCK_N], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_N], tl.float32)
        split_start = split * split_len
        split_end = tl.minimum(split_start + split_len, vocab)
        for v_start in range(split_start, split_end, BLOCK_V):
            vocab_ids = v_start + tl.arange(0, BLOCK_V)
            vocab_ok = vocab_ids < vocab
            w_cols = weight_ptr + vocab_ids.to(tl.int64)[None, :] * stride_wv
            logits = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
            for d_start in range(0, dim, BLOCK_D):
                dims = d_start + tl.arange(0, BLOCK_D)
                dim_ok = dims < dim
                h = tl.load(h_rows + dims[None, :] * stride_hd, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
                w_t = tl.load(w_cols + dims[:, None] * stride_wd, mask=dim_ok[:, None] & vocab_ok[None, :], other=0.0)
                if DOT_IN_FP32:
                    h, w_t = h.to(tl.float32), w_t.to(tl.float32)
                logits = tl.dot(h, w_t, logits, input_precision=DOT_PRECISION)
            if HAS_BIAS:
                logits += tl.load(bias_ptr + vocab_ids, mask=vocab_ok, other=0.0).to(tl.float32)[None, :]
            logits = tl.where(vocab_ok[None, :], logits, float("-inf"))
            # Every tile holds at least one valid vocab id, so new_max is finite and the rescale is safe.
            new_max = tl.maximum(running_max, tl.max(logits, axis=1))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(logits - new_max[:, None]), 1)
            running_max = new_max
        tl.store(partial_lse_ptr + split * n_rows + rows, running_max + tl.log(running_sum), mask=row_ok)

    @triton.jit
    def _label_logprobs_kernel(
        hidden_ptr, weight_ptr, bias_ptr, label_ids_ptr, label_mask_ptr, partial_lse_ptr, out_ptr,
        dim, num_splits,
        stride_hn, stride_hd, stride_wv, stride_wd,
        n_labels, n_rows,
        HAS_BIAS: tl.constexpr, FULL_VOCAB: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        """One read position: dot with its label rows of W, then subtract the labels' or the vocabulary's logsumexp."""
        row = tl.program_id(0).to(tl.int64)
        slots = tl.arange(0, BLOCK_K)
        slot_ok = slots < n_labels
        valid = tl.load(label_mask_ptr + row * n_labels + slots, mask=slot_ok, other=0) != 0
        ids = tl.load(label_ids_ptr + row * n_labels + slots, mask=valid, other=0)
        w_rows = weight_ptr + ids[:, None] * stride_wv
        logits = tl.zeros([BLOCK_K], tl.float32)
        for d_start in range(0, dim, BLOCK_D):
            dims = d_start + tl.arange(0, BLOCK_D)
            dim_ok = dims < dim
            h = tl.load(hidden_ptr + row * stride_hn + dims * stride_hd, mask=dim_ok, other=0.0).to(tl.float32)
            w = tl.load(w_rows + dims[None, :] * stride_wd, mask=valid[:, None] & dim_ok[None, :], other=0.0)
            logits += tl.sum(w.to(tl.float32) * h[None, :], axis=1)
        if HAS_BIAS:
            logits += tl.load(bias_ptr + ids, mask=valid, other=0.0).to(tl.float32)
        logits = tl.where(valid, logits, float("-inf"))
        if FULL_VOCAB:
            splits = tl.arange(0, BLOCK_S)
            partial = tl.load(partial_lse_ptr + splits * n_rows + row, mask=splits < num_splits, other=float("-inf"))
        else:
            partial = logits
        top = tl.max(partial, axis=0)
        logsumexp = top + tl.log(tl.sum(tl.exp(partial - top), axis=0))
        tl.store(out_ptr + row * n_labels + slots, tl.where(valid, logits - logsumexp, float("-inf")), mask=slot_ok)
