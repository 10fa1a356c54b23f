"""The FP8 SwiGLU GEMM of :mod:`rerankit.kernels.swiglu_matmul` as a warp-specialized ping-pong Hopper kernel (Gluon).

Same arguments and the same output, bit for bit: the same K steps into float32 (128 deep), the same epilogue (the
scales, each projection rounded to bf16 as ``F.linear`` rounds it, ``silu(gate) * up`` in float32, then bf16 or
float8 codes under the row's bound). A program is persistent and runs three partitions:

* a loader warpgroup that brings each K step's x tile and the gate and up tiles of the weight through Hopper's copy
  engine (TMA) into a ring of ``STAGES`` shared-memory slots, in the order the consumers take them;
* two consumer warpgroups that take the program's tiles in turn (even ones, odd ones). Each owns a whole tile: 128
  tokens by 64 columns of gate and the same 64 of up, one [128, 128] accumulator. While one runs its epilogue (the
  scales, the activation, the store), the other's MMAs keep the tensor cores busy: the slots come in tile order, so
  the second consumer's MMAs begin as the first one's end.

The Triton kernel (one instruction stream) computes a tile's epilogue with the tensor cores idle: at the 4B shape,
whose K is 20 steps deep, that is ~10% of its time. cuBLAS's own FP8 GEMMs at that shape (o and down, K of 4,096
and 9,728) reach ~1,360 TFLOP/s with 128 x 128 tiles, against ~1,180 for the Triton SwiGLU kernel.
"""

from __future__ import annotations

import torch

from rerankit.kernels import sm_count
from rerankit.kernels.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_AMAX
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

BLOCK_M = 128  # tokens a tile (one consumer warpgroup: two 64-row MMAs)
BLOCK_N = 64  # output columns a tile: 64 of gate and the same 64 of up, one [128, 128] accumulator
BLOCK_K = 128  # float8 K steps (128 bytes: the copy engine's widest swizzle)
# x [128, 128] and weight [128, 128] float8 tiles: 32 KB a slot; two output tiles of [128, 64] (16 KB each in bf16,
# 8 KB in float8). Five slots: 192 KB with bf16 output, 176 KB with float8, under an H100 block's 227. H100 80GB
# HBM3, 2026-11-27, `python benchmarks/swiglu_ws.py` (ms, bits equal to the Triton kernel's): five slots ran the 4B
# MLP at 4k / 8k tokens in 0.315 / 0.660 with float8 output (four: 0.337 / 0.687; six: 0.317 / 0.674; Triton 0.345
# / 0.708), bf16 output 0.328 / 0.674 (four: 0.322 / 0.695); 8B at 4k 0.653 (Triton 0.683); 0.6B at 26.6k 0.316
# (Triton 0.349).
STAGES = {torch.bfloat16: 5, FP8_DTYPE: 5}
GROUP_M = 8
CONSUMER_REGS = 232
# Below this many tokens the Triton kernel runs (a tile or two a program, where the ping-pong has little to overlap).
MIN_TOKENS = 2048


def available() -> bool:
    """Whether this triton has the Gluon Hopper ops the kernel is written in."""
    return gluon is not None


def takes_ws(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`swiglu_ws` runs this projection: ``gluon_gemm.fp8_operands_fit`` with ``MIN_TOKENS``, a
    weight [2I, d] with I a multiple of 16 and no bias."""
    return (bias is None and weight.dim() == 2 and weight.shape[0] % 32 == 0 and weight.shape[-1] == x.shape[-1]
            and fp8_operands_fit(x, weight, MIN_TOKENS))


if gluon is not None:
    _FP8_MAX = gl.constexpr(FP8_MAX)
    _MIN_AMAX = gl.constexpr(MIN_AMAX)

    @gluon.jit
    def _epilogue(acc, row0, col0, xs_ptr, ws_ptr, lengths_ptr, out_scale_ptr, bound, M, N,
                  QUANT_OUT: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
        """``swiglu_matmul``'s epilogue on a [ROWS, 2 * BLOCK_N] accumulator (gate columns, then up): the scales,
        each projection rounded to bf16, ``silu(gate) * up`` in float32; ``QUANT_OUT``: float8 codes under the row's
        bound (``fp8_quant.bounded_codes``), the rows' scales stored by the first column block's tiles."""
        layout: gl.constexpr = acc.type.layout
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        wide = gl.arange(0, 2 * BLOCK_N, layout=gl.SliceLayout(0, layout))
        cols = col0 + wide % BLOCK_N
        col_ok = cols < N
        w_scale = gl.load(ws_ptr + cols + (wide // BLOCK_N) * N, mask=col_ok, other=0.0)
        acc = acc * gl.load(xs_ptr + rows, mask=rows < M, other=0.0)[:, None] * w_scale[None, :]
        acc = acc.to(gl.bfloat16).to(gl.float32)
        gate, up = gl.split(gl.permute(gl.reshape(acc, [ROWS, 2, BLOCK_N]), [0, 2, 1]))
        activated = gate / (1.0 + gl.exp(-gate)) * up
        if QUANT_OUT:
            row_layout: gl.constexpr = gl.SliceLayout(1, activated.type.layout)
            bound_rows = row0 + gl.arange(0, ROWS, layout=row_layout)
            row_ok = bound_rows < M
            row_bound = gl.maximum(gl.load(lengths_ptr + bound_rows, mask=row_ok, other=0.0) * bound, _MIN_AMAX)
            factor = gl.div_rn(gl.full([ROWS], _FP8_MAX, gl.float32, layout=row_layout), row_bound)
            scaled = gl.minimum(gl.maximum(activated * factor[:, None], -_FP8_MAX), _FP8_MAX)
            if col0 == 0:
                gl.store(out_scale_ptr + bound_rows,
                         gl.div_rn(row_bound, gl.full([ROWS], _FP8_MAX, gl.float32, layout=row_layout)),
                         mask=row_ok)
            out = scaled.to(gl.float8e4nv)
        else:
            out = activated.to(gl.bfloat16)
        return out

    @gluon.jit
    def _consumer(out_desc, x_smem, w_smem, out_smem, ready, empty, turn, xs_ptr, ws_ptr, lengths_ptr,
                  out_scale_ptr, bound, M, N, K, CONSUMER: gl.constexpr, QUANT_OUT: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr):
        """The program's tiles CONSUMER, CONSUMER + 2, ...: a tile's MMAs over its K slots (one in flight while the
        next is issued, a slot released once its MMA is done), then the epilogue and the store, while the other
        consumer runs the next tile's MMAs.

        The consumers take turns (``turn``): one waits on its tile's slots only once the other has issued its last
        MMA. A slot's barrier tells two fills apart by parity alone, so a consumer waiting ahead of the other's
        slots would take the other's earlier fill of the same slot for its own."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, 2 * BLOCK_N, 32])
        tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        steps = gl.cdiv(K, BLOCK_K)
        mine = out_smem.index(CONSUMER)
        programs = gl.num_programs(0)
        local = CONSUMER  # the program's tile count so far: slots c = local * steps + k
        turns = 0
        for tile in range(gl.program_id(0) + CONSUMER * programs, tiles, 2 * programs):
            pid_m, pid_n = coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            acc = gl.zeros([BLOCK_M, 2 * BLOCK_N], gl.float32, layout=acc_layout)
            # consumer 0's first turn passes at once (the phase before the barrier's first)
            mbarrier.wait(turn.index(CONSUMER), (turns & 1) ^ (1 - CONSUMER))
            c = local * steps
            for k in range(steps):
                s = c % STAGES
                mbarrier.wait(ready.index(s), (c // STAGES) & 1)
                acc = warpgroup_mma(x_smem.index(s), w_smem.index(s).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])
                if k > 0:  # the previous step's MMA is done: its slot is free
                    mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), count=1)
                c += 1
            mbarrier.arrive(turn.index(1 - CONSUMER), count=1)  # every MMA issued: the other consumer's turn
            turns += 1
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), count=1)
            local += 2
            row0 = pid_m * BLOCK_M
            out = _epilogue(acc, row0, pid_n * BLOCK_N, xs_ptr, ws_ptr, lengths_ptr, out_scale_ptr, bound, M, N,
                            QUANT_OUT, BLOCK_M, BLOCK_N)
            tma.store_wait(0)  # this consumer's last store has read its output slot
            mine.store(out)
            fence_async_shared()
            store(out_desc, [row0, pid_n * BLOCK_N], mine)
        tma.store_wait(0)

    @gluon.jit
    def _swiglu_ws_kernel(x_desc, w_desc, out_desc, xs_ptr, ws_ptr, lengths_ptr, out_scale_ptr, bound, M, N, K,
                          QUANT_OUT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr):
        """Persistent: program p runs tiles p, p + programs, ... in three partitions (the module's docstring)."""
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 2 * BLOCK_N, BLOCK_K], w_desc.layout)
        out_smem = gl.allocate_shared_memory(out_desc.dtype, [2, BLOCK_M, BLOCK_N], out_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (loader, (x_desc, w_desc, x_smem, w_smem, ready, empty, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                      STAGES, 2)),
            (_consumer, (out_desc, x_smem, w_smem, out_smem, ready, empty, turn, xs_ptr, ws_ptr, lengths_ptr,
                         out_scale_ptr, bound, M, N, K, 0, QUANT_OUT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
            (_consumer, (out_desc, x_smem, w_smem, out_smem, ready, empty, turn, xs_ptr, ws_ptr, lengths_ptr,
                         out_scale_ptr, bound, M, N, K, 1, QUANT_OUT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def swiglu_ws(x: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
              quant: tuple[torch.Tensor, float] | None = None,
              stages: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``swiglu_matmul``'s FP8 GEMM (bf16 output) or, given ``quant`` (the rows' squared lengths and the weight's
    bound), ``swiglu_matmul_fp8_out``'s (float8 codes and a scale a row), through the ping-pong kernel; the caller
    checks :func:`takes_ws` first. ``stages``: shared-memory slots (default ``STAGES`` of the output dtype)."""
    from rerankit.kernels.direct_launch import launch

    tokens, width = x.shape[0], weight.shape[0] // 2
    out_dtype = FP8_DTYPE if quant is not None else torch.bfloat16
    out = torch.empty(tokens, width, dtype=out_dtype, device=x.device)
    out_scale = torch.empty(tokens if quant is not None else 0, dtype=torch.float32, device=x.device)
    if tokens:
        lengths, bound = (quant[0].float().contiguous(), float(quant[1])) if quant is not None else (out_scale, 0.0)
        grid = (min(sm_count(x.device, 1), -(-tokens // BLOCK_M) * -(-width // BLOCK_N)),)
        launch(_swiglu_ws_kernel, grid,
               descriptor(x, (BLOCK_M, BLOCK_K)), descriptor(weight, (BLOCK_N, BLOCK_K)),
               descriptor(out, (BLOCK_M, BLOCK_N)), x_scale.float().contiguous(), w_scale.float().contiguous(),
               lengths, out_scale, bound, tokens, width, x.shape[1], QUANT_OUT=quant is not None, BLOCK_M=BLOCK_M,
               BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, STAGES=stages or STAGES[out_dtype],
               CONSUMER_REGS=CONSUMER_REGS, num_warps=4)
    return (out, out_scale) if quant is not None else out
