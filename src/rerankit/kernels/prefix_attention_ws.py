"""The shared-prefix attention of :mod:`rerankit.kernels.prefix_attention` as a warp-specialized Hopper kernel (Gluon).

Same mask, same arguments, forward only; for causal packs where queries see many keys (long instructions, kept
prefix heads), on sm_90 with a Triton that has Gluon. A program is one query block of ``BLOCK_M`` tokens, one kv head
and two of its query heads (``GROUP`` even), in three partitions:

* a loader warpgroup that brings the two Q tiles and then the K/V tiles of every key range the block sees through
  Hopper's copy engine (TMA) into a ring of ``STAGES`` shared-memory slots, each guarded by mbarriers;
* two consumer warpgroups, one per query head, each computing ``S = Q K^T``, the online softmax and ``O += P V`` on
  its own 64..128-row tile with warpgroup MMAs (P from registers). The two share every K/V tile and run independently,
  so one's softmax overlaps the other's MMAs (what FlashAttention-3 gets from its ping-pong schedule).

Key ranges, in order, are those of the pointer kernel: the kept prefix keys (``cached``), the batch's shared prefix
keys that every query of the block sees, then the block's own spans up to its last query. Only tiles that cross a
range's end or lie in the spans are masked elementwise.
"""

from __future__ import annotations

import functools

import torch
import triton

from rerankit.kernels import cuda_capability, rows_take_tma, sm_count
from rerankit.kernels.direct_launch import launch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
except ImportError:  # a triton without Gluon's Hopper ops: the pointer/descriptor kernel serves every call
    gluon = None

WS_STAGES = 2
WS_BLOCK_N = 128
WS_CONSUMER_REGS = 240


def available() -> bool:
    """Whether this triton has the Gluon Hopper ops the kernel is written in."""
    return gluon is not None


def takes_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, reads, cached) -> bool:
    """Whether :func:`prefix_attention_ws` can run this call: Gluon, an sm_90 device, 16-bit q/k/v whose token rows
    keep each tensor's heads side by side with 16-byte strides (TMA), head_dim 64 or 128, an even number of query heads
    per kv head, causal attention and every row (``reads`` None)."""
    if gluon is None or not q.is_cuda or not causal or reads is not None:
        return False
    if cuda_capability(q.device)[0] != 9 or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    head_dim, group = q.shape[2], q.shape[1] // max(k.shape[1], 1)
    if head_dim not in (64, 128) or group % 2 or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    return rows_take_tma(q, k, v) and (cached is None or rows_take_tma(cached[1], cached[2]))


if gluon is not None:

    @gluon.jit
    def _bounds(w, cu_seqlens, prefix_lens, cached_lens, span_starts, n_mblocks, n_pairs, n_seqs,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_CACHED: gl.constexpr, layout: gl.constexpr):
        """Work item ``w`` and the key ranges its query block sees (every partition computes the same):
        (pair, seq_start, seq_end, q_first, prefix_end, lo_span, hi_span, shared_end, cached, n_cached, n_shared,
        n_tiles): lo_span / hi_span are the least and greatest span start of the block's queries.

        Items run by query block, the last blocks (those that see the most keys) first, then by sequence, then by
        query-head pair, so that programs running side by side read the same K/V tiles. A block past its sequence's
        end has no tiles (n_tiles == 0)."""
        pair = w % n_pairs
        seq = (w // n_pairs) % n_seqs
        m_block = n_mblocks - 1 - w // (n_pairs * n_seqs)
        seq_start = gl.load(cu_seqlens + seq).to(gl.int32)
        seq_end = gl.load(cu_seqlens + seq + 1).to(gl.int32)
        q_first = seq_start + m_block * BLOCK_M
        q_last = gl.minimum(q_first + BLOCK_M, seq_end) - 1
        prefix_end = seq_start + gl.load(prefix_lens + seq).to(gl.int32)
        tokens = q_first + gl.arange(0, BLOCK_M, layout=layout)
        spans = gl.load(span_starts + tokens, mask=tokens < seq_end, other=seq_end).to(gl.int32)
        lo_span = gl.min(spans, axis=0)
        hi_span = gl.max(gl.where(tokens < seq_end, spans, seq_start), axis=0)
        shared_end = gl.minimum(prefix_end, lo_span)
        if HAS_CACHED:
            cached = gl.load(cached_lens + seq).to(gl.int32)
        else:
            cached = seq_start * 0
        n_cached = gl.cdiv(cached, BLOCK_N)
        n_shared = gl.cdiv(shared_end - seq_start, BLOCK_N)
        n_tiles = n_cached + n_shared + gl.cdiv(q_last + 1 - lo_span, BLOCK_N)
        n_tiles = gl.where(q_first < seq_end, n_tiles, 0)
        return (pair, seq_start, seq_end, q_first, prefix_end, lo_span, hi_span, shared_end, cached, n_cached, n_shared,
                n_tiles)

    @gluon.jit
    def _tile(j, n_cached, n_shared, seq_start, lo_span, cached, shared_end, BLOCK_N: gl.constexpr):
        """Key tile j of a work item: (first key, kept, limit). Kept prefix keys (rows of the kept tensors) come
        first, every query seeing those before ``limit`` = cached; then the batch's shared prefix keys, seen before
        ``limit`` = shared_end; then the block's own spans (limit -1: the full mask)."""
        if j < n_cached:
            start = j * BLOCK_N
            kept = True
            limit = cached
        elif j < n_cached + n_shared:
            start = seq_start + (j - n_cached) * BLOCK_N
            kept = False
            limit = shared_end
        else:
            start = lo_span + (j - n_cached - n_shared) * BLOCK_N
            kept = False
            limit = seq_start * 0 - 1
        return start, kept, limit

    @gluon.jit
    def _loader(q_desc, k_desc, v_desc, ck_desc, cv_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                kv_empty, cu_seqlens, prefix_lens, cached_lens, span_starts, n_mblocks, n_pairs, n_seqs, n_work,
                GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                STAGES: gl.constexpr, HAS_CACHED: gl.constexpr):
        """The loader partition: per work item, both Q tiles into the Q slot (of two) that the consumers are done
        with, then K and V tile c of the program's whole sequence into slot c % STAGES once both consumers have
        released it."""
        layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                                warps_per_cta=[gl.num_warps()], order=[0])
        c = 0
        i = 0
        for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
            pair, seq_start, seq_end, q_first, prefix_end, lo_span, hi_span, shared_end, cached, n_cached, n_shared, \
                n_tiles = \
                _bounds(w, cu_seqlens, prefix_lens, cached_lens, span_starts, n_mblocks, n_pairs, n_seqs,
                        BLOCK_M, BLOCK_N, HAS_CACHED, layout)
            if n_tiles > 0:
                kv_col = (2 * pair) // GROUP * HEAD_DIM
                buf = i % 2
                mbarrier.wait(q_empty.index(buf), ((i // 2) & 1) ^ 1)
                mbarrier.expect(q_ready.index(buf), 2 * q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [q_first, 2 * pair * HEAD_DIM], q_ready.index(buf),
                                                q_smem.index(2 * buf))
                tma.async_copy_global_to_shared(q_desc, [q_first, (2 * pair + 1) * HEAD_DIM], q_ready.index(buf),
                                                q_smem.index(2 * buf + 1))
                i += 1
                for j in range(n_tiles):
                    stage = c % STAGES
                    mbarrier.wait(kv_empty.index(stage), ((c // STAGES) & 1) ^ 1)
                    mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
                    mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
                    start, kept, limit = _tile(j, n_cached, n_shared, seq_start, lo_span, cached, shared_end, BLOCK_N)
                    if kept:
                        tma.async_copy_global_to_shared(ck_desc, [start, kv_col], k_ready.index(stage),
                                                        k_smem.index(stage))
                        tma.async_copy_global_to_shared(cv_desc, [start, kv_col], v_ready.index(stage),
                                                        v_smem.index(stage))
                    else:
                        tma.async_copy_global_to_shared(k_desc, [start, kv_col], k_ready.index(stage),
                                                        k_smem.index(stage))
                        tma.async_copy_global_to_shared(v_desc, [start, kv_col], v_ready.index(stage),
                                                        v_smem.index(stage))
                    c += 1

    @gluon.jit
    def _consumer(out_ptr, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
                  cu_seqlens, prefix_lens, cached_lens, span_starts, n_mblocks, n_pairs, n_seqs, n_work,
                  stride_ot, stride_oh, qk_scale,
                  CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                  STAGES: gl.constexpr, HAS_CACHED: gl.constexpr):
        """One query head's rows (``BLOCK_M`` tokens) of each work item: S = Q K^T, the masked online softmax,
        O += P V per K/V slot, then O / l stored for the tokens of the sequence."""
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        store_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                      warps_per_cta=[4, 1], order=[1, 0])
        scale = qk_scale * 1.4426950408889634  # exp2 instead of exp
        c = 0
        i = 0
        for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
            pair, seq_start, seq_end, q_first, prefix_end, lo_span, hi_span, shared_end, cached, n_cached, n_shared, \
                n_tiles = \
                _bounds(w, cu_seqlens, prefix_lens, cached_lens, span_starts, n_mblocks, n_pairs, n_seqs,
                        BLOCK_M, BLOCK_N, HAS_CACHED, row_s)
            if n_tiles > 0:
                tokens = q_first + gl.arange(0, BLOCK_M, layout=row_s)
                token_valid = tokens < seq_end
                span_q = gl.load(span_starts + tokens, mask=token_valid, other=0).to(gl.int32)
                m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, layout=row_s)  # finite: a fully masked tile keeps alpha 1
                l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
                acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
                buf = i % 2
                q_tile = q_smem.index(2 * buf + CONSUMER)
                mbarrier.wait(q_ready.index(buf), (i // 2) & 1)
                # Tiles in [hi_span, q_first] lie in every query's span and before every query: no mask.
                full_lo = hi_span
                full_hi = q_first + 1
                for j in range(n_tiles):
                    stage = c % STAGES
                    phase = (c // STAGES) & 1
                    mbarrier.wait(k_ready.index(stage), phase)
                    qk = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)),
                                       gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout), use_acc=False)
                    start, kept, limit = _tile(j, n_cached, n_shared, seq_start, lo_span, cached, shared_end, BLOCK_N)
                    if limit < 0 and (start < full_lo or start + BLOCK_N > full_hi):
                        keys = start + gl.arange(0, BLOCK_N, layout=col_s)
                        visible = (keys[None, :] < prefix_end) | (keys[None, :] >= span_q[:, None])
                        qk = gl.where((keys[None, :] <= tokens[:, None]) & visible, qk, float("-inf"))
                    elif limit >= 0 and start + BLOCK_N > limit:
                        keys = start + gl.arange(0, BLOCK_N, layout=col_s)
                        qk = gl.where((keys < limit)[None, :], qk, float("-inf"))
                    m_new = gl.maximum(m_i, gl.max(qk, axis=1) * scale)
                    alpha = gl.exp2(m_i - m_new)
                    p = gl.exp2(qk * scale - m_new[:, None])
                    l_i = l_i * alpha + gl.sum(p, axis=1)
                    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                    mbarrier.wait(v_ready.index(stage), phase)
                    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(stage), acc)
                    mbarrier.arrive(kv_empty.index(stage), count=1)
                    m_i = m_new
                    c += 1
                mbarrier.arrive(q_empty.index(buf), count=1)
                i += 1
                l_o = gl.convert_layout(gl.where(token_valid, l_i, 1.0), row_o)
                out = gl.convert_layout((acc / l_o[:, None]).to(out_ptr.dtype.element_ty), store_layout)
                rows = q_first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
                cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, store_layout))
                head = 2 * pair + CONSUMER
                ptrs = out_ptr + rows[:, None].to(gl.int64) * stride_ot + (head * stride_oh + cols)[None, :]
                gl.store(ptrs, out, mask=(rows < seq_end)[:, None])

    @gluon.jit
    def _prefix_attention_ws_kernel(
        q_desc, k_desc, v_desc, ck_desc, cv_desc, out_ptr, cu_seqlens, prefix_lens, span_starts, cached_lens,
        n_mblocks, n_pairs, n_seqs, stride_ot, stride_oh, qk_scale,
        GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr, HAS_CACHED: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    ):
        """Persistent: program p runs work items p, p + programs, ... (see ``_bounds``)."""
        dtype: gl.constexpr = q_desc.dtype
        n_work = n_mblocks * n_pairs * n_seqs
        q_smem = gl.allocate_shared_memory(dtype, [4, BLOCK_M, HEAD_DIM], q_desc.layout)  # 2 slots x 2 heads
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)
        fence_async_shared()
        gl.warp_specialize([
            (_loader, (q_desc, k_desc, v_desc, ck_desc, cv_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                       v_ready, kv_empty, cu_seqlens, prefix_lens, cached_lens, span_starts, n_mblocks, n_pairs,
                       n_seqs, n_work, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, HAS_CACHED)),
            (_consumer, (out_ptr, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, cu_seqlens,
                         prefix_lens, cached_lens, span_starts, n_mblocks, n_pairs, n_seqs, n_work, stride_ot,
                         stride_oh, qk_scale, 0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, HAS_CACHED)),
            (_consumer, (out_ptr, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, cu_seqlens,
                         prefix_lens, cached_lens, span_starts, n_mblocks, n_pairs, n_seqs, n_work, stride_ot,
                         stride_oh, qk_scale, 1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, HAS_CACHED)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def _descriptor(x: torch.Tensor, columns: int, block: list[int]):
    """``x`` [T, H, D] as the 2-D [T, columns] it is in memory (each token's heads side by side)."""
    return GluonDescriptor(x, [x.shape[0], columns], [x.stride(0), 1], block, _smem_layout(tuple(block), x.dtype))


@functools.lru_cache(maxsize=32)
def _smem_layout(block: tuple[int, int], dtype: torch.dtype):
    """The swizzled shared-memory layout of a ``block`` tile, computed once (~5 us of host time a descriptor)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def prefix_attention_ws(q, k, v, cu_seqlens, max_seqlen, prefix_lens, span_starts, scale, *, cached=None,
                        block_m: int = 64, block_n: int = WS_BLOCK_N, stages: int = WS_STAGES,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`rerankit.kernels.prefix_attention.prefix_attention` (causal, every row) through the warp-specialized
    kernel; the caller checks :func:`takes_ws` first. ``block_m`` query tokens of two heads a work item, K/V tiles of
    ``block_n`` keys in ``stages`` slots. ``out`` (an empty [T, Hq, D] with unit stride over D) takes the result in
    place of a new tensor."""
    total, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    out = torch.empty_like(q) if out is None else out
    if total == 0:
        return out
    q_desc = _descriptor(q, q_heads * head_dim, [block_m, head_dim])
    k_desc, v_desc = (_descriptor(x, kv_heads * head_dim, [block_n, head_dim]) for x in (k, v))
    if cached is None:
        cached_lens, ck_desc, cv_desc = prefix_lens, k_desc, v_desc
    else:
        cached_lens = cached[0]
        ck_desc, cv_desc = (_descriptor(x, kv_heads * head_dim, [block_n, head_dim]) for x in cached[1:])
    n_mblocks, n_pairs, n_seqs = triton.cdiv(max_seqlen, block_m), q_heads // 2, cu_seqlens.numel() - 1
    grid = (max(1, min(n_mblocks * n_pairs * n_seqs, sm_count(q.device, 1))),)
    launch(
        _prefix_attention_ws_kernel, grid,
        q_desc, k_desc, v_desc, ck_desc, cv_desc, out, cu_seqlens, prefix_lens, span_starts, cached_lens,
        n_mblocks, n_pairs, n_seqs, out.stride(0), out.stride(1), scale,
        GROUP=q_heads // kv_heads, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim, STAGES=stages,
        HAS_CACHED=cached is not None, CONSUMER_REGS=WS_CONSUMER_REGS, num_warps=4,
    )
    return out

