"""Packed varlen attention with a shared-prefix (multi-item scoring) mask, forward only.

Sequences lie end to end in ``[T, heads, head_dim]`` tensors, delimited by ``cu_seqlens``. In a
causal sequence, query ``i`` sees key ``j`` when ``j <= i`` and either ``j`` lies in the sequence's
shared prefix (``j < seq_start + prefix_len``) or in the query's own span (``j >= span_starts[i]``).
``prefix_len = 0`` with ``span_starts`` at the sequence start is plain packed causal attention;
``causal=False`` is full bidirectional attention within each sequence (encoders).

The Triton kernel is flash-attention style (online softmax, fp32 accumulation). A query block
visits only the key ranges that some of its queries can see: the prefix keys that every query of
the block sees, then its own spans up to its last query. Tiles that every query sees fully skip
the elementwise mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes and launch shape of the kernel."""

    block_m: int = 128
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3


def default_config(device: torch.device) -> AttentionConfig:
    """Kernel tiles for ``device``: one shape for every workload on CUDA, small tiles for the CPU interpreter.

    128x32 with 4 warps was fastest or within 10% of the fastest on each H100 pack of
    benchmarks/attention.py --sweep (short W1 pairs, MIS, 1k prefixes, 32k documents, D=64 encoders).
    """
    if device.type != "cuda":
        # The interpreter runs numpy per program; small tiles keep test packs multi-tile.
        return AttentionConfig(block_m=32, block_n=16, num_warps=1, num_stages=1)
    return AttentionConfig()


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, k_head_ptr, v_head_ptr, stride_kt, stride_vt,
    offs_m, offs_d, span_q, prefix_end, key_lo, key_hi, qk_scale,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Online-softmax update of one query block over keys [key_lo, key_hi).

    MASKED=False: the caller guarantees whole tiles that every query of the block sees.
    """
    for tile_start in range(key_lo, key_hi, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        k_ptrs = k_head_ptr + offs_n[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = v_head_ptr + offs_n[:, None] * stride_vt + offs_d[None, :]
        if MASKED:
            in_range = offs_n < key_hi
            k = tl.load(k_ptrs, mask=in_range[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            allowed = in_range[None, :]
            if CAUSAL:
                keys = offs_n[None, :]
                visible = (keys < prefix_end) | (keys >= span_q[:, None])
                allowed = allowed & (keys <= offs_m[:, None]) & visible
            qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefix_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens, prefix_lens, span_starts,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    # Last query blocks see the most keys: launch them first so the tail of the grid is short.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    seq_start = tl.load(cu_seqlens + seq).to(tl.int32)
    seq_end = tl.load(cu_seqlens + seq + 1).to(tl.int32)
    q_first = seq_start + m_block * BLOCK_M
    if q_first >= seq_end:
        return
    q_last = tl.minimum(q_first + BLOCK_M, seq_end) - 1

    offs_m = q_first + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = offs_m < seq_end
    q = tl.load(q_ptr + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_valid[:, None], other=0.0)
    k_head_ptr = k_ptr + (head // GROUP) * stride_kh
    v_head_ptr = v_ptr + (head // GROUP) * stride_vh

    if CAUSAL:
        prefix_end = seq_start + tl.load(prefix_lens + seq).to(tl.int32)
        span_q = tl.load(span_starts + offs_m, mask=row_valid, other=0).to(tl.int32)
        lo_span = tl.min(tl.where(row_valid, span_q, seq_end), 0)
        hi_span = tl.max(tl.where(row_valid, span_q, seq_start), 0)
        # Keys before min(prefix_end, lo_span) are prefix keys every query of the block sees.
        shared_end = tl.minimum(prefix_end, lo_span)
        # Keys in [hi_span, q_first] lie in every query's span and before every query.
        full_end = hi_span + tl.maximum(q_first + 1 - hi_span, 0) // BLOCK_N * BLOCK_N
        kv_end = q_last + 1
    else:
        prefix_end = seq_start
        span_q = offs_m
        lo_span = seq_start
        hi_span = seq_start
        shared_end = seq_start
        full_end = seq_start + (seq_end - seq_start) // BLOCK_N * BLOCK_N
        kv_end = seq_end
    shared_full_end = seq_start + (shared_end - seq_start) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile gives alpha=1, not NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = qk_scale * 1.4426950408889634  # exp2 instead of exp
    # Shared prefix, then own spans: [lo_span, hi_span) masked, [hi_span, full_end) full, rest masked.
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, stride_kt, stride_vt, offs_m, offs_d,
                                  span_q, prefix_end, seq_start, shared_full_end, qk_scale, CAUSAL, False, BLOCK_N)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, stride_kt, stride_vt, offs_m, offs_d,
                                  span_q, prefix_end, shared_full_end, shared_end, qk_scale, CAUSAL, True, BLOCK_N)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, stride_kt, stride_vt, offs_m, offs_d,
                                  span_q, prefix_end, lo_span, hi_span, qk_scale, CAUSAL, True, BLOCK_N)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, stride_kt, stride_vt, offs_m, offs_d,
                                  span_q, prefix_end, hi_span, full_end, qk_scale, CAUSAL, False, BLOCK_N)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, stride_kt, stride_vt, offs_m, offs_d,
                                  span_q, prefix_end, full_end, kv_end, qk_scale, CAUSAL, True, BLOCK_N)

    out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
    tl.store(out_ptr + offs_m[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    prefix_lens: torch.Tensor,
    span_starts: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    *,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """Packed attention under the shared-prefix mask: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D].

    ``prefix_lens`` is [B] (zeros when no sequence shares a prefix), ``span_starts`` is [T].
    """
    total, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of key/value heads ({kv_heads})")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty_like(q)
    if total == 0:
        return out
    config = config or default_config(q.device)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    grid = (triton.cdiv(max_seqlen, config.block_m), q_heads, cu_seqlens.numel() - 1)
    _prefix_attention_kernel[grid](
        q, k, v, out, cu_seqlens, prefix_lens, span_starts,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        scale,
        GROUP=q_heads // kv_heads, CAUSAL=causal,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def prefix_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    prefix_lens: torch.Tensor,
    span_starts: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """The same attention as :func:`prefix_attention`, one torch SDPA call per sequence with a boolean mask.

    ``max_seqlen`` is unused; it keeps the kernel's signature so the two are interchangeable.
    """
    out = torch.empty_like(q)
    bounds, prefix_lens = cu_seqlens.tolist(), prefix_lens.tolist()
    for seq, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end == start:
            continue
        mask = None
        if causal:
            keys = torch.arange(start, end, device=q.device)
            prefix_end = start + prefix_lens[seq]
            visible = (keys[None, :] < prefix_end) | (keys[None, :] >= span_starts[start:end, None])
            mask = (keys[None, :] <= keys[:, None]) & visible
        heads_first = [x[start:end].transpose(0, 1) for x in (q, k, v)]
        attended = F.scaled_dot_product_attention(*heads_first, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = attended.transpose(0, 1)
    return out
