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

Two variants, chosen by :attr:`AttentionConfig.pack_gqa`:

* ``pack_gqa=False``: one program per (query block, query head, sequence); a block is
  ``block_m`` tokens of one query head, so the ``GROUP = Hq // Hkv`` heads that share a kv head
  load its K/V tiles ``GROUP`` times.
* ``pack_gqa=True`` (the CUDA default): one program per (query block, kv head, sequence); its Q tile stacks the
  ``GROUP`` query heads of the kv head over ``block_m`` tokens (``GROUP * block_m`` rows, token
  major: row ``r`` is token ``q_first + r // GROUP_PAD`` of head ``r % GROUP_PAD`` of the group,
  ``GROUP_PAD`` the next power of two, padding heads masked). Each K/V tile is loaded once per group
  and ``block_m`` can shrink (32 tokens x 2 heads = 64 rows), which wastes less of the causal
  diagonal tiles on short spans. The per-row mask uses each row's token, so the skip logic is the same.

The config comes from :func:`default_config` unless a caller passes one. To switch it without code
changes, set ``RERANKIT_ATTENTION_CONFIG`` to comma-separated ``field=value`` pairs of
:class:`AttentionConfig`, applied on top of the device's default (CUDA and the CPU interpreter alike)::

    RERANKIT_ATTENTION_CONFIG="pack_gqa=1,block_m=64,block_n=64,num_warps=4,num_stages=3"

Fields left out keep the default; ``pack_gqa`` and ``tma`` take 1/0/true/false/yes/no, ``maxnreg`` also
none (or 0) for no cap. Causal attention's default is chosen per call by the mean number of keys a query sees
(``keys_per_query``, which the planner puts on each ``PackedBatch``): small tiles for short item spans (16 tokens a
program instead of 32 where four or more query heads share a kv head, so a program keeps 64 rows), larger ones where
queries see long prefixes or documents. To change the defaults in code, edit :data:`CUDA_DEFAULT_CONFIG`,
:data:`CUDA_WIDE_GROUP_CONFIG`, :data:`CUDA_LONG_KEYS_CONFIG` (causal) and :data:`CUDA_BIDIRECTIONAL_CONFIG` in
``kernels/attention_config.py``.

``tma=True`` reads the K and V tiles through tensor descriptors (Hopper's copy engine) where their layout allows it
(``takes_tma``: each token's heads side by side, as the q/k/v projection leaves them), else through pointers.
``warp_specialized=True`` (the long-keys default) hands causal calls that compute every row to the Gluon kernel of
:mod:`rerankit.kernels.prefix_attention_ws` where it runs (sm_90, 16-bit, an even query-head group), and this kernel
serves the rest.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rerankit.kernels import rows_take_tma, run_gluon
from rerankit.kernels.direct_launch import launch
from rerankit.kernels.attention_config import AttentionConfig, default_config
from rerankit.kernels.fp8_quant import _INTERPRET, FP8_DTYPE, bounded_codes, bounded_scale, quantize_bounded

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older triton: K/V through pointers only
    TensorDescriptor = None


# The read-token kernel (``reads=``): a Q tile of one token's heads, repeated to a tensor-core dot's least height.
READ_ROWS = 16
READ_WARPS = 4


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, kv, queries, key_lo, key_hi, qk_scale,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):
    """Online-softmax update of one query block over keys [key_lo, key_hi).

    ``kv`` = (k_head_ptr, v_head_ptr, stride_kt, stride_vt, k_desc, v_desc, kv_col): where the K and V tiles of the
    block's kv head come from; ``queries`` = (offs_m, offs_d, span_q, prefix_end): each row's token, the head
    dimensions, each row's span start and the sequence's prefix end.
    MASKED=False: the caller guarantees whole tiles that every query of the block sees. TMA: K and V tiles come
    through the descriptors (column ``kv_col``); rows past key_hi are then real keys of other spans (zeros past the
    pack), masked out of the scores, so their V rows get weight 0.
    """
    k_head_ptr, v_head_ptr, stride_kt, stride_vt, k_desc, v_desc, kv_col = kv
    offs_m, offs_d, span_q, prefix_end = queries
    for tile_start in range(key_lo, key_hi, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        k_ptrs = k_head_ptr + offs_n[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = v_head_ptr + offs_n[:, None] * stride_vt + offs_d[None, :]
        if MASKED:
            in_range = offs_n < key_hi
        if TMA:
            k = k_desc.load([tile_start, kv_col])
        elif MASKED:
            k = tl.load(k_ptrs, mask=in_range[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        qk = tl.dot(q, tl.trans(k))  # unscaled: the scale goes into the exponent's one fused multiply-add
        if MASKED:
            allowed = in_range[None, :]
            if CAUSAL:
                keys = offs_n[None, :]
                visible = (keys < prefix_end) | (keys >= span_q[:, None])
                allowed = allowed & (keys <= offs_m[:, None]) & visible
            qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # the running maximum, scaled
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if TMA:
            v = v_desc.load([tile_start, kv_col])
        elif MASKED:
            v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_block(
    q, offs_m, token_valid, k_head_ptr, v_head_ptr, stride_kt, stride_vt, k_desc, v_desc, kv_col, offs_d,
    prefix_lens, span_starts, seq, seq_start, seq_end, q_first, q_last, qk_scale, cached_lens, cached_kv,
    CAUSAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr,
    HAS_CACHED: tl.constexpr,
):
    """Attention of one block of query rows (tokens ``offs_m``, queries ``q`` [ROWS, D]) over the key ranges its
    tokens can see; (acc, l) of the online softmax. Both kernels call it, with their own row layouts. HAS_CACHED:
    the sequence's first ``cached_lens[seq]`` prefix keys are rows of other tensors (``cached_kv``, laid out as
    ``kv``), seen by every query before the batch's own keys."""
    if CAUSAL:
        prefix_end = seq_start + tl.load(prefix_lens + seq).to(tl.int32)
        span_q = tl.load(span_starts + offs_m, mask=token_valid, other=0).to(tl.int32)
        lo_span = tl.min(tl.where(token_valid, span_q, seq_end), 0)
        hi_span = tl.max(tl.where(token_valid, span_q, seq_start), 0)
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

    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile gives alpha=1, not NaN
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    qk_scale = qk_scale * 1.4426950408889634  # exp2 instead of exp
    kv = (k_head_ptr, v_head_ptr, stride_kt, stride_vt, k_desc, v_desc, kv_col)
    queries = (offs_m, offs_d, span_q, prefix_end)
    if HAS_CACHED:
        # Cached prefix keys (rows [0, cached) of their own tensors) come before every key of the sequence, so every
        # query sees them: whole tiles unmasked, the last one masked past ``cached`` only (CAUSAL=False).
        cached = tl.load(cached_lens + seq).to(tl.int32)
        cached_full_end = cached // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, cached_kv, queries, 0, cached_full_end, qk_scale,
                                      False, False, BLOCK_N, TMA)
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, cached_kv, queries, cached_full_end, cached, qk_scale,
                                      False, True, BLOCK_N, TMA)
    # Shared prefix, then own spans: [lo_span, hi_span) masked, [hi_span, full_end) full, rest masked.
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, kv, queries, seq_start, shared_full_end, qk_scale,
                                  CAUSAL, False, BLOCK_N, TMA)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, kv, queries, shared_full_end, shared_end, qk_scale,
                                  CAUSAL, True, BLOCK_N, TMA)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, kv, queries, lo_span, hi_span, qk_scale, CAUSAL, True, BLOCK_N, TMA)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, kv, queries, hi_span, full_end, qk_scale, CAUSAL, False, BLOCK_N,
                                  TMA)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, kv, queries, full_end, kv_end, qk_scale, CAUSAL, True, BLOCK_N, TMA)
    return acc, l_i


@triton.jit
def _query_block(cu_seqlens, BLOCK_M: tl.constexpr):
    """This program's sequence and query block: (seq, seq_start, seq_end, q_first, q_last). The last query blocks
    see the most keys, so they are launched first and the tail of the grid is short; q_first >= seq_end means the
    block lies past its sequence (the caller returns)."""
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(2)
    seq_start = tl.load(cu_seqlens + seq).to(tl.int32)
    seq_end = tl.load(cu_seqlens + seq + 1).to(tl.int32)
    q_first = seq_start + m_block * BLOCK_M
    q_last = tl.minimum(q_first + BLOCK_M, seq_end) - 1
    return seq, seq_start, seq_end, q_first, q_last


@triton.jit
def _store_out(out, out_ptr, offsets, mask, bound_ptr, scales_ptr, scale_rows, scale_mask, first_group,
               FP8_OUT: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """An output tile (float32) stored in ``out_ptr``'s dtype; ``FP8_OUT``: as e4m3 codes under the one scale
    ``bound / 448`` (``fp8_quant.bounded_codes``), which the programs of the ``first_group`` of heads also store
    for their rows (``scale_rows`` where ``scale_mask``)."""
    if FP8_OUT:
        bound = tl.load(bound_ptr)
        tl.store(out_ptr + offsets, bounded_codes(out, bound, ROUND_FIRST).to(out_ptr.dtype.element_ty), mask=mask)
        if first_group:
            tl.store(scales_ptr + scale_rows, tl.zeros(scale_rows.shape, tl.float32) + bounded_scale(bound),
                     mask=scale_mask)
    else:
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefix_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, k_desc, v_desc, cu_seqlens, prefix_lens, span_starts,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale, cached_lens, ck_ptr, cv_ptr, ck_desc, cv_desc, stride_ckt, stride_ckh, stride_cvt, stride_cvh,
    bound_ptr, scales_ptr,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr,
    HAS_CACHED: tl.constexpr, FP8_OUT: tl.constexpr, ROUND_FIRST: tl.constexpr,
):
    head = tl.program_id(1)
    seq, seq_start, seq_end, q_first, q_last = _query_block(cu_seqlens, BLOCK_M)
    if q_first >= seq_end:
        return

    offs_m = q_first + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = offs_m < seq_end
    q = tl.load(q_ptr + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_valid[:, None], other=0.0)
    k_head_ptr = k_ptr + (head // GROUP) * stride_kh
    v_head_ptr = v_ptr + (head // GROUP) * stride_vh

    cached_kv = (ck_ptr + (head // GROUP) * stride_ckh, cv_ptr + (head // GROUP) * stride_cvh, stride_ckt, stride_cvt,
                 ck_desc, cv_desc, (head // GROUP) * HEAD_DIM)
    acc, l_i = _attend_block(q, offs_m, row_valid, k_head_ptr, v_head_ptr, stride_kt, stride_vt, k_desc, v_desc,
                             (head // GROUP) * HEAD_DIM, offs_d, prefix_lens, span_starts, seq, seq_start, seq_end,
                             q_first, q_last, qk_scale, cached_lens, cached_kv, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM,
                             TMA, HAS_CACHED)

    out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
    _store_out(out, out_ptr, offs_m[:, None] * stride_ot + head * stride_oh + offs_d[None, :], row_valid[:, None],
               bound_ptr, scales_ptr, offs_m, row_valid, head == 0, FP8_OUT, ROUND_FIRST)


@triton.jit
def _prefix_attention_packed_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, k_desc, v_desc, cu_seqlens, prefix_lens, span_starts,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale, cached_lens, ck_ptr, cv_ptr, ck_desc, cv_desc, stride_ckt, stride_ckh, stride_cvt, stride_cvh,
    bound_ptr, scales_ptr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr,
    HAS_CACHED: tl.constexpr, FP8_OUT: tl.constexpr, ROUND_FIRST: tl.constexpr,
):
    """_prefix_attention_kernel with the GROUP query heads of one kv head in one program (pack_gqa=True).

    Q tile rows are token major: row r is token q_first + r // GROUP_PAD of query head
    kv_head * GROUP + r % GROUP_PAD (rows of padding heads, r % GROUP_PAD >= GROUP, are computed on
    zeros and never stored). Block bounds depend on tokens only, so they are the unpacked kernel's.
    """
    ROWS: tl.constexpr = BLOCK_M * GROUP_PAD
    kv_head = tl.program_id(1)
    seq, seq_start, seq_end, q_first, q_last = _query_block(cu_seqlens, BLOCK_M)
    if q_first >= seq_end:
        return

    rows = tl.arange(0, ROWS)
    offs_m = q_first + rows // GROUP_PAD  # each row's token
    heads = kv_head * GROUP + rows % GROUP_PAD
    offs_d = tl.arange(0, HEAD_DIM)
    token_valid = offs_m < seq_end
    if GROUP_PAD == GROUP:
        row_valid = token_valid
    else:
        row_valid = token_valid & (rows % GROUP_PAD < GROUP)
    q = tl.load(q_ptr + offs_m[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None], other=0.0)
    k_head_ptr = k_ptr + kv_head * stride_kh
    v_head_ptr = v_ptr + kv_head * stride_vh

    cached_kv = (ck_ptr + kv_head * stride_ckh, cv_ptr + kv_head * stride_cvh, stride_ckt, stride_cvt, ck_desc, cv_desc,
                 kv_head * HEAD_DIM)
    acc, l_i = _attend_block(q, offs_m, token_valid, k_head_ptr, v_head_ptr, stride_kt, stride_vt, k_desc, v_desc,
                             kv_head * HEAD_DIM, offs_d, prefix_lens, span_starts, seq, seq_start, seq_end, q_first,
                             q_last, qk_scale, cached_lens, cached_kv, CAUSAL, ROWS, BLOCK_N, HEAD_DIM, TMA,
                             HAS_CACHED)

    out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
    _store_out(out, out_ptr, offs_m[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
               row_valid[:, None], bound_ptr, scales_ptr, offs_m, token_valid & (rows % GROUP_PAD == 0),
               kv_head == 0, FP8_OUT, ROUND_FIRST)


@triton.jit
def _prefix_attention_reads_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, k_desc, v_desc, cu_seqlens, prefix_lens, span_starts, reads_ptr, n_seqs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale, cached_lens, ck_ptr, cv_ptr, ck_desc, cv_desc, stride_ckt, stride_ckh, stride_cvt, stride_cvh,
    bound_ptr, scales_ptr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, TMA: tl.constexpr, HAS_CACHED: tl.constexpr, FP8_OUT: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
):
    """The attention of one read token (``reads[program_id(0)]``) for the GROUP query heads of one kv head: the
    rows of the full kernel's output at that token. The Q tile repeats the token's GROUP_PAD head rows to ROWS
    (a tensor-core dot's least height); rows past GROUP_PAD, and padding heads, are never stored."""
    read = tl.program_id(0)
    kv_head = tl.program_id(1)
    token = tl.load(reads_ptr + read).to(tl.int32)
    # The token's sequence: the last s with cu_seqlens[s] <= token (empty sequences before it share its start)
    lo = token * 0
    hi = lo + n_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        right = tl.load(cu_seqlens + mid) <= token
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    seq = lo
    seq_start = tl.load(cu_seqlens + seq).to(tl.int32)
    seq_end = tl.load(cu_seqlens + seq + 1).to(tl.int32)

    rows = tl.arange(0, ROWS)
    offs_m = token + rows * 0
    heads = kv_head * GROUP + rows % GROUP_PAD
    offs_d = tl.arange(0, HEAD_DIM)
    stored = (rows < GROUP_PAD) & (rows % GROUP_PAD < GROUP)
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=(rows % GROUP_PAD < GROUP)[:, None], other=0.0)
    cached_kv = (ck_ptr + kv_head * stride_ckh, cv_ptr + kv_head * stride_cvh, stride_ckt, stride_cvt, ck_desc, cv_desc,
                 kv_head * HEAD_DIM)
    acc, l_i = _attend_block(q, offs_m, rows < ROWS, k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh,
                             stride_kt, stride_vt, k_desc, v_desc, kv_head * HEAD_DIM, offs_d, prefix_lens,
                             span_starts, seq, seq_start, seq_end, token, token, qk_scale, cached_lens, cached_kv,
                             CAUSAL, ROWS, BLOCK_N, HEAD_DIM, TMA, HAS_CACHED)
    out = acc / l_i[:, None]
    _store_out(out, out_ptr, read * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], stored[:, None],
               bound_ptr, scales_ptr, read + rows * 0, rows == 0, kv_head == 0, FP8_OUT, ROUND_FIRST)


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
    keys_per_query: float = 0.0,
    cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    reads: torch.Tensor | None = None,
    fp8_bound: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Packed attention under the shared-prefix mask: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D].

    ``prefix_lens`` is [B] (zeros when no sequence shares a prefix), ``span_starts`` is [T]. Without a ``config``
    the tiles are :func:`default_config`'s for ``keys_per_query`` (the mean keys a query sees; 0: not known) and the
    query heads a kv head has.
    ``cached`` = (cached_lens [B], k_cached [C, Hkv, D], v_cached): sequence b's prefix begins with the first
    ``cached_lens[b]`` rows of k_cached/v_cached (keys kept from an earlier forward), which every token of the
    sequence sees before its own keys; its ``prefix_lens`` count the prefix tokens in the batch only.
    ``reads`` [R] (token indices): only those tokens' rows, [R, Hq, D], each computed by a program of its own (the
    last layer of a forward whose heads read one token an item needs no other row).
    ``fp8_bound`` [1] float32, a bound of |output| (the largest |v|: each output row is a convex combination of v
    rows): the output comes as float8_e4m3fn codes [T, Hq, D] under one scale, ``fp8_bound / 448``, with that
    scale per row [T] (``fp8_quant.quantize_bounded``'s numbers, for an FP8 o projection with no pass of its own).
    """
    total, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of key/value heads ({kv_heads})")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if cached is not None and not causal:
        raise ValueError("cached prefix keys need causal attention")
    rows = total if reads is None else reads.numel()
    out = q.new_empty(rows, q_heads, head_dim, dtype=q.dtype if fp8_bound is None else FP8_DTYPE)
    scales = out.new_empty(rows if fp8_bound is not None else 0, dtype=torch.float32)
    if out.shape[0] == 0:
        return out if fp8_bound is None else (out, scales)
    group = q_heads // kv_heads
    config = config or default_config(q.device, causal, keys_per_query, group)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if not scale > 0:
        raise ValueError(f"the attention scale must be positive, not {scale}")  # the running maximum is scaled
    if config.warp_specialized and q.is_cuda:
        from rerankit.kernels import prefix_attention_ws  # Gluon, imported at first use (~30 ms of import time)

        if prefix_attention_ws.takes_ws(q, k, v, causal, reads, cached):
            got = run_gluon("attention", lambda: prefix_attention_ws.prefix_attention_ws(
                q, k, v, cu_seqlens, max_seqlen, prefix_lens, span_starts, scale, cached=cached,
                out=out if fp8_bound is None else None))
            if got is not None:
                if fp8_bound is None:
                    return got
                codes, scales = quantize_bounded(got.flatten(1), fp8_bound)  # its own pass after the Gluon kernel
                return codes.view(got.shape), scales
    group_pad = triton.next_power_of_2(group)
    if reads is not None:  # one program per read token and kv head
        kernel, grid = _prefix_attention_reads_kernel, (reads.numel(), kv_heads)
        packing = {"GROUP_PAD": group_pad, "ROWS": max(group_pad, READ_ROWS)}
        extra = (reads, cu_seqlens.numel() - 1)
    elif config.pack_gqa:  # one program per kv head and its GROUP query heads
        kernel, grid = _prefix_attention_packed_kernel, (triton.cdiv(max_seqlen, config.block_m), kv_heads)
        packing = {"GROUP_PAD": group_pad, "BLOCK_M": config.block_m}
        extra = ()
    else:
        kernel, grid = _prefix_attention_kernel, (triton.cdiv(max_seqlen, config.block_m), q_heads)
        packing, extra = {"BLOCK_M": config.block_m}, ()
    if reads is None:
        grid = (*grid, cu_seqlens.numel() - 1)
    if cached is None:  # the kernel never reads these without HAS_CACHED
        cached_lens, ck, cv = prefix_lens, k, v
    else:
        cached_lens, ck, cv = cached[0], *(x if x.stride(-1) == 1 else x.contiguous() for x in cached[1:])
    tma = config.tma and takes_tma(k, v) and (cached is None or takes_tma(ck, cv))
    limits = {"maxnreg": config.maxnreg} if config.maxnreg is not None and q.is_cuda and reads is None else {}
    warps = {"num_warps": config.num_warps if reads is None else READ_WARPS, "num_stages": config.num_stages}
    k_desc, v_desc = (_kv_descriptor(x, config.block_n) for x in (k, v)) if tma else (k, v)
    ck_desc, cv_desc = (k_desc, v_desc) if cached is None else \
        (_kv_descriptor(x, config.block_n) for x in (ck, cv)) if tma else (ck, cv)
    launch(
        kernel, grid, q, k, v, out, k_desc, v_desc, cu_seqlens, prefix_lens, span_starts, *extra,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        scale, cached_lens, ck, cv, ck_desc, cv_desc, ck.stride(0), ck.stride(1), cv.stride(0), cv.stride(1),
        scales if fp8_bound is None else fp8_bound, scales,
        GROUP=group, CAUSAL=causal, BLOCK_N=config.block_n, HEAD_DIM=head_dim, TMA=tma,
        HAS_CACHED=cached is not None, FP8_OUT=fp8_bound is not None, ROUND_FIRST=_INTERPRET, **warps, **packing,
        **limits,
    )
    return out if fp8_bound is None else (out, scales)


def takes_tma(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether K and V can be read through tensor descriptors: a triton that has them, each token's heads side by
    side ([T, H * D] rows, as the q/k/v projection lays them out), 16-byte row strides and a 16-byte aligned start."""
    return TensorDescriptor is not None and rows_take_tma(k, v)


def _kv_descriptor(x: torch.Tensor, block_n: int):
    """K or V [T, H, D] as the 2-D [T, H * D] it is in memory: a tile is block_n keys of one head (column h * D)."""
    total, heads, head_dim = x.shape
    return TensorDescriptor(x, [total, heads * head_dim], [x.stride(0), 1], [block_n, head_dim])


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
    cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The same attention as :func:`prefix_attention`, one torch SDPA call per sequence with a boolean mask.

    ``max_seqlen`` is unused; it keeps the kernel's signature so the two are interchangeable.
    """
    out = torch.empty_like(q)
    bounds, prefix_lens = cu_seqlens.tolist(), prefix_lens.tolist()
    cached_lens = [0] * len(prefix_lens) if cached is None else cached[0].tolist()
    for seq, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end == start:
            continue
        mask = None
        if causal:
            keys = torch.arange(start, end, device=q.device)
            prefix_end = start + prefix_lens[seq]
            visible = (keys[None, :] < prefix_end) | (keys[None, :] >= span_starts[start:end, None])
            mask = (keys[None, :] <= keys[:, None]) & visible
        keys_values = [k[start:end], v[start:end]]
        if cached_lens[seq]:
            keys_values = [torch.cat([kept[:cached_lens[seq]], own]) for kept, own in zip(cached[1:], keys_values)]
            mask = torch.cat([mask.new_ones(end - start, cached_lens[seq]), mask], dim=1)
        heads_first = [x.transpose(0, 1) for x in (q[start:end], *keys_values)]
        attended = F.scaled_dot_product_attention(*heads_first, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = attended.transpose(0, 1)
    return out
