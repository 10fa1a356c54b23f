"""The q/k/v GEMM of :mod:`rerankit.kernels.qkv_rope_matmul` as a warp-specialized Hopper kernel (Gluon), for FP8.

Same arguments and the same output, bit for bit: the same tiles (128 tokens x two heads), the same 128-deep K steps
into float32 accumulators, the same epilogue (scales, bias, ``F.linear``'s rounding, qk_norm_rope's norm and rotation
in float32, one rounding at the store). What differs is where the work sits. A program is persistent and runs three
partitions:

* a loader warpgroup that brings each tile's x and weight K steps through Hopper's copy engine (TMA) into a ring of
  ``STAGES`` shared-memory slots, running ahead across tiles while the consumers are in their epilogue;
* two consumer warpgroups, one per 64-token half of the tile, each issuing its warpgroup MMAs over the shared slots
  and then running the epilogue on its own [64, 256] accumulator, storing through shared memory and TMA.

The epilogue reads the rotary table (``rope_table``'s float32 cos/sin) in the accumulator's own register layout,
chosen here by hand. The Triton kernel cannot: Triton loads the table in a layout of its own and moves it into the
accumulator's through shared memory, 32 KB a tile, which also leaves no room for a third stage of 128-deep steps
(``benchmarks/qkv_epilogue.py``). H100, ms, this kernel against the Triton one: W1's 26.6k tokens of Qwen3-0.6B
0.261 / 0.278, 4B's 8k 0.227 / 0.243, 8B's 4k 0.172 / 0.179; 4B calls of 32 documents 465.4 / 459.8 pairs/s
(``benchmarks/fp8_calls.py --env "RERANKIT_QKV_KERNEL=triton;"``).
"""

from __future__ import annotations

import torch

from rerankit.kernels import sm_count
from rerankit.kernels.direct_launch import launch
from rerankit.kernels.gluon_gemm import (
    coords,
    descriptor,
    fence_async_shared,
    fp8_operands_fit,
    gl,
    gluon,
    loader,
    mbarrier,
    store,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BLOCK_M = 128  # tokens a tile: two consumer warpgroups of 64
BLOCK_N = 256  # columns a tile: two heads of 128
BLOCK_K = 128  # float8 K steps (128 bytes: the copy engine's widest swizzle)
STAGES = 3  # 3 x 48 KB of x and weight slots, plus 2 x 32 KB of output tiles: 208 KB of shared memory
GROUP_M = 8
CONSUMER_REGS = 232
# Below this many tokens the Triton kernel runs (a tile or two a program, where the loader's head start matters
# little and the launch's host time more).
MIN_TOKENS = 2048

def available() -> bool:
    """Whether this triton has the Gluon Hopper ops the kernel is written in."""
    return gluon is not None


def takes_ws(x: torch.Tensor, weight: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`qkv_rope_ws` runs this projection: ``gluon_gemm.fp8_operands_fit`` with ``MIN_TOKENS``, and
    heads of 128 in even numbers (a tile holds two q, two k or two v heads)."""
    return head_dim == 128 and not num_heads % 2 and not num_kv_heads % 2 and fp8_operands_fit(x, weight, MIN_TOKENS)


if gluon is not None:

    @gluon.jit
    def _epilogue(acc, row0, col0, b_ptr, xs_ptr, ws_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, M, N, eps,
                  HEAD_DIM: gl.constexpr, NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr,
                  HAS_BIAS: gl.constexpr, HAS_NORM: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
        """``qkv_rope_matmul``'s ``_norm_rotate`` on a [ROWS, BLOCK_N] accumulator, with the table read in the
        layout the rotation needs."""
        layout: gl.constexpr = acc.type.layout
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        acc = acc * gl.load(xs_ptr + rows, mask=rows < M, other=0.0)[:, None] \
            * gl.load(ws_ptr + cols, mask=cols < N, other=0.0)[None, :]
        if HAS_BIAS:
            acc += gl.load(b_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)[None, :]
        acc = acc.to(gl.bfloat16)
        HALF: gl.constexpr = HEAD_DIM // 2
        HEADS: gl.constexpr = BLOCK_N // HEAD_DIM
        first_head = col0 // HEAD_DIM
        if first_head < NUM_HEADS + NUM_KV_HEADS:
            # [ROWS, HEADS, HALF, 2]: each head's two halves side by side, in registers
            first, second = gl.split(gl.permute(gl.reshape(acc.to(gl.float32), [ROWS, HEADS, 2, HALF]),
                                                [0, 1, 3, 2]))
            table_layout: gl.constexpr = gl.SliceLayout(1, first.type.layout)  # [ROWS, HALF], broadcast over heads
            dims = gl.arange(0, HALF, layout=gl.SliceLayout(0, table_layout))
            if HAS_NORM:
                is_q = first_head < NUM_HEADS
                w_first = gl.where(is_q, gl.load(q_norm_ptr + dims), gl.load(k_norm_ptr + dims)).to(gl.float32)
                w_second = gl.where(is_q, gl.load(q_norm_ptr + HALF + dims),
                                    gl.load(k_norm_ptr + HALF + dims)).to(gl.float32)
                scale = gl.rsqrt((gl.sum(first * first, axis=2) + gl.sum(second * second, axis=2)) / HEAD_DIM
                                 + eps)[:, :, None]
                first = w_first[None, None, :] * (first * scale)
                second = w_second[None, None, :] * (second * scale)
            table_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, table_layout))
            table = table_rows.to(gl.int64)[:, None] * HALF + dims[None, :]
            row_ok = (table_rows < M)[:, None]
            cos = gl.load(cos_ptr + table, mask=row_ok, other=0.0)[:, None, :]
            sin = gl.load(sin_ptr + table, mask=row_ok, other=0.0)[:, None, :]
            both = gl.join(first * cos - second * sin, second * cos + first * sin)
            acc = gl.convert_layout(gl.reshape(gl.permute(both, [0, 1, 3, 2]), [ROWS, BLOCK_N]).to(gl.bfloat16),
                                    layout)  # the same registers: no data moves
        return acc

    @gluon.jit
    def _consumer(out_desc, x_smem, w_smem, out_smem, ready, empty, b_ptr, xs_ptr, ws_ptr, cos_ptr, sin_ptr,
                  q_norm_ptr, k_norm_ptr, M, N, K, eps, CONSUMER: gl.constexpr, HEAD_DIM: gl.constexpr,
                  NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, HAS_BIAS: gl.constexpr,
                  HAS_NORM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """One 64-token half of each tile: its MMAs over the K slots (one in flight while the next is issued, a
        slot released once both halves' MMAs on it are done), then the epilogue and the store."""
        ROWS: gl.constexpr = BLOCK_M // 2
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        steps = gl.cdiv(K, BLOCK_K)
        mine = out_smem.index(CONSUMER)
        c = 0
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            pid_m, pid_n = coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            acc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=acc_layout)
            for k in range(steps):
                s = c % STAGES
                mbarrier.wait(ready.index(s), (c // STAGES) & 1)
                acc = warpgroup_mma(x_smem.index(s).slice(CONSUMER * ROWS, ROWS), w_smem.index(s).permute((1, 0)),
                                    acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])
                if k > 0:  # the previous step's MMA is done: its slot is free
                    mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), count=1)
                c += 1
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), count=1)
            row0 = pid_m * BLOCK_M + CONSUMER * ROWS
            out = _epilogue(acc, row0, pid_n * BLOCK_N, b_ptr, xs_ptr, ws_ptr, cos_ptr, sin_ptr, q_norm_ptr,
                            k_norm_ptr, M, N, eps, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, HAS_BIAS, HAS_NORM, ROWS,
                            BLOCK_N)
            tma.store_wait(0)  # the last tile's store has read this half's output slot
            mine.store(out)
            fence_async_shared()
            store(out_desc, [row0, pid_n * BLOCK_N], mine)
        tma.store_wait(0)

    @gluon.jit
    def _qkv_rope_ws_kernel(x_desc, w_desc, out_desc, b_ptr, xs_ptr, ws_ptr, cos_ptr, sin_ptr, q_norm_ptr,
                            k_norm_ptr, M, N, K, eps, HEAD_DIM: gl.constexpr, NUM_HEADS: gl.constexpr,
                            NUM_KV_HEADS: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_NORM: gl.constexpr,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                            GROUP_M: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr):
        """Persistent: program p runs tiles p, p + programs, ... in three partitions (the module's docstring)."""
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        out_smem = gl.allocate_shared_memory(out_desc.dtype, [2, BLOCK_M // 2, BLOCK_N], out_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        fence_async_shared()
        gl.warp_specialize([
            (loader, (x_desc, w_desc, x_smem, w_smem, ready, empty, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                      STAGES, 1)),
            (_consumer, (out_desc, x_smem, w_smem, out_smem, ready, empty, b_ptr, xs_ptr, ws_ptr, cos_ptr, sin_ptr,
                         q_norm_ptr, k_norm_ptr, M, N, K, eps, 0, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, HAS_BIAS,
                         HAS_NORM, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
            (_consumer, (out_desc, x_smem, w_smem, out_smem, ready, empty, b_ptr, xs_ptr, ws_ptr, cos_ptr, sin_ptr,
                         q_norm_ptr, k_norm_ptr, M, N, K, eps, 1, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, HAS_BIAS,
                         HAS_NORM, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def qkv_rope_ws(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int, num_kv_heads: int,
                head_dim: int, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                k_norm: torch.Tensor | None, eps: float, x_scale: torch.Tensor, w_scale: torch.Tensor,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """:func:`rerankit.kernels.qkv_rope_matmul.qkv_rope_matmul` for float8 ``x`` and ``weight`` (checked there) through
    the warp-specialized kernel; the caller checks :func:`takes_ws` first. bf16 output only."""
    if out_dtype != torch.bfloat16:
        raise ValueError(f"the warp-specialized q/k/v kernel writes bf16, not {out_dtype}")
    tokens, width = x.shape[0], weight.shape[0]
    out = torch.empty(tokens, width, dtype=torch.bfloat16, device=x.device)
    if tokens == 0:
        return out
    x_scale, w_scale = x_scale.float().contiguous(), w_scale.float().contiguous()
    has_norm = q_norm is not None
    grid = (min(sm_count(x.device, 1), -(-tokens // BLOCK_M) * -(-width // BLOCK_N)),)
    launch(
        _qkv_rope_ws_kernel, grid, descriptor(x, (BLOCK_M, BLOCK_K)), descriptor(weight, (BLOCK_N, BLOCK_K)),
        descriptor(out, (BLOCK_M // 2, BLOCK_N)), bias if bias is not None else cos, x_scale, w_scale,
        cos.contiguous(), sin.contiguous(), q_norm if has_norm else cos, k_norm if has_norm else cos,
        tokens, width, x.shape[1], eps, HEAD_DIM=head_dim, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HAS_BIAS=bias is not None, HAS_NORM=has_norm, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        GROUP_M=GROUP_M, STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS, num_warps=4)
    return out
