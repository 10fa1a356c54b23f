"""The gate/up projection of a SwiGLU MLP with the activation in its epilogue: ``silu(x @ Wg.T) * (x @ Wu.T)``.

The decoder keeps gate and up fused in one weight ``[2I, d]`` (gate rows first). cuBLAS writes the whole ``[T, 2I]``
projection and a second kernel reads it back to write ``[T, I]``: for Qwen3-0.6B's I = 3,072 that is 30 KB a token
a layer, the largest share of the "elementwise" time in W1's profile. Here one program computes the gate tile and
the up tile of the same columns from the same x tile (two accumulators, one x load), applies the activation in
registers and writes only ``[T, I]``.

Rounding follows the torch path (``F.linear`` then Inductor's fused ``silu(gate) * up``): each projection is rounded
to the activation dtype, then silu and the product run in float32 and round once at the store.

The Triton kernel runs on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1; anything else falls back to
``swiglu_matmul_reference``. Opt-in in the decoder (``PackedDecoder.fused_swiglu``) until a GPU run shows it
beating cuBLAS + Inductor (``benchmarks/pairs.py --ab``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still serves machines without triton
    triton = None

# Triton decides at decoration time whether a kernel is interpreted, so read the flag at the same moment.
_INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def _check(x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be [T, d] and weight [2I, d], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1] or weight.shape[0] % 2:
        raise ValueError(f"weight must be [2I, {x.shape[1]}] (gate rows, then up rows), got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def swiglu_matmul_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Plain torch: the fused projection, split into gate and up, ``silu(gate) * up`` (the decoder's ``swiglu``)."""
    _check(x, weight, bias)
    gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


def swiglu_matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``silu(x @ Wg.T + bg) * (x @ Wu.T + bu)`` [T, I] for ``weight`` = [Wg; Wu] [2I, d] and ``bias`` [2I]."""
    if triton is None or not (x.is_cuda or _INTERPRET):  # the reference checks its inputs the same way
        return swiglu_matmul_reference(x, weight, bias)
    _check(x, weight, bias)
    x, weight = x.contiguous(), weight.contiguous()
    tokens, width = x.shape[0], weight.shape[0] // 2
    out = torch.empty(tokens, width, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    kernel = _swiglu_matmul_kernel_interpreted if _INTERPRET else _swiglu_matmul_kernel
    grid = lambda meta: (triton.cdiv(tokens, meta["BLOCK_M"]) * triton.cdiv(width, meta["BLOCK_N"]),)  # noqa: E731
    kernel[grid](x, weight, bias if bias is not None else weight, out, tokens, width, x.shape[1],
                 HAS_BIAS=bias is not None)
    return out


if triton is not None:

    def _swiglu_matmul_body(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """One [BLOCK_M, BLOCK_N] tile of the output; programs walk the tiles in groups of GROUP_M row blocks, so
        neighbouring programs share weight tiles in the L2 cache."""
        pid = tl.program_id(0)
        blocks_m = tl.cdiv(M, BLOCK_M)
        blocks_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * blocks_n
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        col_ok = cols < N
        x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :]
        gate_ptrs = w_ptr + cols.to(tl.int64)[None, :] * K + ks[:, None]  # Wg.T tile [BLOCK_K, BLOCK_N]
        up_ptrs = gate_ptrs + N * K  # the up rows follow the gate rows
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            k_ok = ks < K - start
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            gate = tl.dot(a, tl.load(gate_ptrs, mask=w_mask, other=0.0), gate)
            up = tl.dot(a, tl.load(up_ptrs, mask=w_mask, other=0.0), up)
            x_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
        if HAS_BIAS:
            gate += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out_type = out_ptr.dtype.element_ty
        gate = gate.to(out_type).to(tl.float32)  # each projection rounded as F.linear rounds it
        up = up.to(out_type).to(tl.float32)
        activated = gate / (1.0 + tl.exp(-gate)) * up
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out_ptrs, activated.to(out_type), mask=row_ok[:, None] & col_ok[None, :])

    # Two accumulators per program: 128 x 64 fp32 tiles with 8 warps hold 64 registers a thread each. Autotuned once
    # per (N, K), on the first call's batch (a CUDA-graph capture warms up eagerly first, so tuning never runs
    # inside a capture).
    _CONFIGS = [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    ]
    _swiglu_matmul_kernel = triton.autotune(_CONFIGS, key=["N", "K"])(triton.jit(_swiglu_matmul_body))
    # The interpreter runs one small tile: tuning there would only multiply the test time.
    _swiglu_matmul_kernel_interpreted = triton.autotune(
        [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2})], key=["N", "K"])(
        triton.jit(_swiglu_matmul_body))
