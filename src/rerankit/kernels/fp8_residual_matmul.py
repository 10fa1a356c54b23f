"""A residual FP8 projection that quantizes its own input: ``hidden += e4m3(x / s) @ W.T * s * w_scale (+ bias)``.

The decoder's o and down projections read a bf16 activation (the attention output, the SwiGLU output) and add
their product onto the residual stream. Quantizing that activation in a pass of its own (read bf16, write float8
codes and scales) and adding the GEMM's bf16 output in another (read, read, write) cost W1 on the 0.6B shape more
than the FP8 GEMMs saved (H100, 2026-11-25: 5.3 ms of quantization and 2.9 ms of adds in a 39 ms call). Here
one Triton kernel does all three:

    s[t]      = max(amax[t], MIN_AMAX) / 448        amax[t]: the row's max |x[t, :]| (from its producer)
    q[t, k]   = e4m3(clamp(x[t, k] * (448 / max(amax[t], MIN_AMAX)), -448, 448))   in registers, never stored
    hidden[t] = bf16(hidden[t] + (sum_k q[t, k] * w[n, k]) * s[t] * w_scale[n] (+ bias[n]))   float32 inside

The row amax comes from whoever produced ``x``: the FP8 SwiGLU GEMM's epilogue (``swiglu_matmul(amax_out=...)``)
or one reduction over the attention output. Codes are those of ``quantize_rows`` (scaled by the reciprocal,
which is a multiplication per element instead of a division), and the sum is rounded once, after the residual
add. The descriptor kernel needs Hopper's copy engine (or the interpreter); elsewhere the reference runs.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from rerankit.kernels import launch_tuned
from rerankit.kernels.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_AMAX

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still serves machines without triton
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

_INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def _check(x: Tensor, x_amax: Tensor, weight: Tensor, w_scale: Tensor, hidden: Tensor, bias: Tensor | None) -> None:
    if weight.dtype != FP8_DTYPE or x.dtype == FP8_DTYPE:
        raise ValueError(f"weight must be {FP8_DTYPE} and x 16/32-bit, got {weight.dtype} and {x.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [T, d] and weight [N, d], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if hidden.shape != (x.shape[0], weight.shape[0]):
        raise ValueError(f"hidden must be [{x.shape[0]}, {weight.shape[0]}], got {tuple(hidden.shape)}")
    if x_amax.shape != (x.shape[0],) or w_scale.shape != (weight.shape[0],):
        raise ValueError(f"x_amax must be [{x.shape[0]}] and w_scale [{weight.shape[0]}], got "
                         f"{tuple(x_amax.shape)} and {tuple(w_scale.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def row_amax(x: Tensor) -> Tensor:
    """Each row's max |x[t, :]| [T], in one reduction (no |x| tensor)."""
    return torch.linalg.vector_norm(x, ord=float("inf"), dim=-1)


def quantize_with_amax_reference(x: Tensor, x_amax: Tensor) -> tuple[Tensor, Tensor]:
    """Plain torch: the kernel's codes [T, d] and float32 scales [T] of ``x`` given its rows' amax."""
    amax = x_amax.float().clamp(min=MIN_AMAX)
    codes = (x.float() * (FP8_MAX / amax)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, amax / FP8_MAX


def fp8_residual_matmul_reference(x: Tensor, x_amax: Tensor, weight: Tensor, w_scale: Tensor, hidden: Tensor,
                                  bias: Tensor | None = None) -> Tensor:
    """Plain torch: ``hidden`` updated in place (and returned), the product summed in float32 from exact code
    products, added to the residual in float32, rounded once."""
    _check(x, x_amax, weight, w_scale, hidden, bias)
    codes, scale = quantize_with_amax_reference(x, x_amax)
    product = (codes.float() @ weight.float().T) * scale[:, None] * w_scale.float()[None, :]
    if bias is not None:
        product = product + bias.float()
    return hidden.copy_(hidden.float() + product)


def takes_tma(x: Tensor, weight: Tensor, hidden: Tensor) -> bool:
    """Whether the descriptor kernel applies: Hopper's copy engine (or the interpreter), contiguous rows of 16-byte
    multiples, a float32/16-bit ``x``."""
    if triton is None or TensorDescriptor is None or not (x.is_cuda or _INTERPRET):
        return False
    if x.is_cuda:
        from rerankit.kernels.swiglu_matmul import has_copy_engine

        if not has_copy_engine(x.device) or x.element_size() != 2:
            return False
    rows_ok = all(t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
                  for t in (x, weight, hidden))
    return rows_ok and (x.shape[1] * x.element_size()) % 16 == 0 and (weight.shape[0] * 2) % 16 == 0


def fp8_residual_matmul(x: Tensor, x_amax: Tensor, weight: Tensor, w_scale: Tensor, hidden: Tensor,
                        bias: Tensor | None = None) -> Tensor:
    """``hidden`` [T, N] += the FP8 product of ``x`` [T, d] (quantized per row from ``x_amax`` [T]) and float8
    ``weight`` [N, d] with its float32 ``w_scale`` [N] (+ ``bias``), in place; returns ``hidden``."""
    _check(x, x_amax, weight, w_scale, hidden, bias)
    if x.shape[0] == 0:
        return hidden
    if not takes_tma(x, weight, hidden):
        return fp8_residual_matmul_reference(x, x_amax, weight, w_scale, hidden, bias)
    tokens, width, depth = x.shape[0], weight.shape[0], x.shape[1]
    x_desc, w_desc, h_desc = (TensorDescriptor.from_tensor(t, [16, 16]) for t in (x, weight, hidden))
    grid = lambda meta: (triton.cdiv(tokens, meta["BLOCK_M"]) * triton.cdiv(width, meta["BLOCK_N"]),)  # noqa: E731
    args = (x_desc, w_desc, x_amax, w_scale, bias if bias is not None else w_scale, h_desc, tokens, width, depth)
    meta = dict(HAS_BIAS=bias is not None, ROUND_FIRST=_INTERPRET)
    if _INTERPRET:
        _residual_kernel_interpreted[grid](*args, **meta)
    else:
        descriptors = {"x_desc": x_desc, "w_desc": w_desc, "h_desc": h_desc}
        launch_tuned(_residual_kernel, (width, depth, bias is not None), grid, args, meta,
                     lambda config: _set_block_shapes({**descriptors, **config.kwargs}))
    return hidden


if triton is not None:
    from rerankit.kernels.fp8_quant import _round_to_e4m3
    from rerankit.kernels.swiglu_matmul import grouped_tile

    _MAX = tl.constexpr(FP8_MAX)
    _MIN_AMAX = tl.constexpr(MIN_AMAX)

    def _residual_body(x_desc, w_desc, amax_ptr, ws_ptr, b_ptr, h_desc, M, N, K, HAS_BIAS: tl.constexpr,
                       ROUND_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """One [BLOCK_M, BLOCK_N] tile: x tiles quantized in registers, FP8 dots, then scales, bias and the
        residual tile, stored over it. ``ROUND_FIRST``: round to e4m3 in float32 before the cast (the
        interpreter's cast does not round)."""
        pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        amax = tl.maximum(tl.load(amax_ptr + rows, mask=rows < M, other=1.0).to(tl.float32), _MIN_AMAX)
        inverse = tl.expand_dims(tl.full([BLOCK_M], _MAX, tl.float32) / amax, 1)  # 448 / amax, as the reference
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(tl.cdiv(K, BLOCK_K)):
            a = tl.clamp(x_desc.load([pid_m * BLOCK_M, step * BLOCK_K]).to(tl.float32) * inverse, -_MAX, _MAX)
            if ROUND_FIRST:
                a = _round_to_e4m3(a)
            w = w_desc.load([pid_n * BLOCK_N, step * BLOCK_K])
            acc = tl.dot(a.to(w.dtype), w.T, acc)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out = acc * tl.expand_dims(amax / _MAX, 1) * tl.load(ws_ptr + cols, mask=cols < N, other=0.0)[None, :]
        if HAS_BIAS:
            out += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        residual = h_desc.load([pid_m * BLOCK_M, pid_n * BLOCK_N]).to(tl.float32)
        h_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], (residual + out).to(h_desc.dtype))

    def _set_block_shapes(nargs: dict) -> None:
        block_m, block_n, block_k = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
        nargs["x_desc"].block_shape = [block_m, block_k]
        nargs["w_desc"].block_shape = [block_n, block_k]
        nargs["h_desc"].block_shape = [block_m, block_n]

    # bf16 x tiles and float8 weight tiles: [128, 128] x [128, 128] is 48 KB a stage. Tuned once per (N, K, bias).
    _CONFIGS = [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=8, num_stages=3,
                      pre_hook=_set_block_shapes),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4,
                      pre_hook=_set_block_shapes),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3,
                      pre_hook=_set_block_shapes),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=4, num_stages=4,
                      pre_hook=_set_block_shapes),
    ]
    _residual_kernel = triton.autotune(_CONFIGS, key=["N", "K", "HAS_BIAS"])(triton.jit(_residual_body))
    _residual_kernel_interpreted = triton.autotune(
        [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2}, pre_hook=_set_block_shapes)],
        key=["N", "K"])(triton.jit(_residual_body))
