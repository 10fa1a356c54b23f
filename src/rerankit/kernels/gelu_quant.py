"""The encoder's FP8 feed-forward activation in one Triton pass: bias, GELU, and float8 codes under a bound a row.

    u      = round_bf16(projected + bias)                     the up projection's output, as torch adds the bias
    bound  = max(lengths[t] * up_bound[0] + up_bound[1], 0.17)    |x| max_n |w_n| + max |b|, or GELU's least value
    codes  = e4m3(clamp(gelu(u) * 448 / bound, +-448)),  scale[t] = bound / 448

(``engine.models.encoder_fp8`` explains the bound.) One read of the bf16 [T, 4d] input and one write of the codes:
Inductor's fusion of the same expression recomputed each row's bound in every element and ran at ~1.15 TB/s on an
H100 (6.4 of 31.5 ms of kernels on a BERT-large call). The kernel runs on CUDA tensors, or on CPU tensors when
TRITON_INTERPRET=1; otherwise ``gelu_codes_reference`` (plain torch) serves. ``gelu_codes`` is the Triton op
``rerankit::gelu_codes``: inside a compiled step Inductor launches the kernel from its own code.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from rerankit.kernels.fp8_quant import FP8_DTYPE, FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still serves machines without triton
    triton = None

_INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
GELU_MIN = 0.17  # a bound of |GELU(u)| for u < 0 (its least value is -0.1700 at u = -0.75; tanh's approximation alike)
_BLOCK_T, _BLOCK_N = 16, 256


def gelu_codes_reference(projected: Tensor, bias: Tensor, lengths: Tensor, up_bound: Tensor,
                         approximate: str) -> tuple[Tensor, Tensor]:
    """Plain torch: the bias added in ``projected``'s dtype, GELU in float32, codes [T, N] and scales [T]."""
    bound = torch.clamp(lengths.float() * up_bound[0] + up_bound[1], min=GELU_MIN)
    factor = torch.div(torch.full_like(bound, FP8_MAX), bound)
    inner = F.gelu((projected + bias).float(), approximate=approximate)
    codes = (inner * factor[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, torch.div(bound, torch.full_like(bound, FP8_MAX))


def _gelu_codes(projected: Tensor, bias: Tensor, lengths: Tensor, up_bound: Tensor,
                approximate: str) -> tuple[Tensor, Tensor]:
    """``gelu_codes_reference``'s result: the Triton kernel where it runs (CUDA, or the interpreter on the CPU)."""
    if triton is None or not (projected.is_cuda or _INTERPRET):
        return gelu_codes_reference(projected, bias, lengths, up_bound, approximate)
    rows, width = projected.shape
    codes = torch.empty(rows, width, dtype=FP8_DTYPE, device=projected.device)
    scale = torch.empty(rows, dtype=torch.float32, device=projected.device)
    grid = (triton.cdiv(rows, _BLOCK_T), triton.cdiv(width, _BLOCK_N))
    _launch(_gelu_codes_kernel)[grid](projected, bias, lengths, up_bound, codes, scale, rows, width,
                                      projected.stride(0), TANH=approximate == "tanh", ROUND_FIRST=_INTERPRET,
                                      BLOCK_T=_BLOCK_T, BLOCK_N=_BLOCK_N)
    return codes, scale


if triton is not None:
    from torch.library import triton_op, wrap_triton

    # A Triton op: inside a compiled step Inductor launches the kernel from its own generated code (a Python custom
    # op's wrapper and Triton's launcher had cost more host time than the kernel saved: BERT-large FP8 calls fell
    # from 2,552 to 1,716 pairs/s, eager launches being host-bound). Called eagerly it runs the function as it is.
    _launch = wrap_triton
    gelu_codes = triton_op("rerankit::gelu_codes", mutates_args=())(_gelu_codes)
else:
    gelu_codes = _gelu_codes

if triton is not None:
    from rerankit.kernels.fp8_quant import bounded_codes, bounded_scale

    _GELU_MIN = tl.constexpr(GELU_MIN)

    @triton.jit
    def _gelu_codes_kernel(x_ptr, b_ptr, lengths_ptr, bound_ptr, codes_ptr, scale_ptr, T, N, stride_x,
                           TANH: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_N: tl.constexpr):
        """A [BLOCK_T, BLOCK_N] tile: each row's bound once, then bias, GELU and codes per element; the programs of
        the first column block store the rows' scales."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < T, cols < N
        weight_max = tl.load(bound_ptr)
        bias_max = tl.load(bound_ptr + 1)
        length = tl.load(lengths_ptr + rows, mask=row_ok, other=0.0)
        row_bound = tl.maximum(length * weight_max + bias_max, _GELU_MIN)
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0)
        u = (x.to(tl.float32) + bias.to(tl.float32)[None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)
        if TANH:
            inner = 0.7978845608028654 * (u + 0.044715 * u * u * u)
            gelu = 0.5 * u * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
        else:
            gelu = 0.5 * u * (1.0 + tl.erf(u * 0.7071067811865476))
        codes = bounded_codes(gelu, row_bound[:, None], ROUND_FIRST)
        tl.store(codes_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], codes.to(codes_ptr.dtype.element_ty),
                 mask=mask)
        if tl.program_id(1) == 0:
            tl.store(scale_ptr + rows, bounded_scale(row_bound), mask=row_ok)
