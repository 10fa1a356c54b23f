"""FP8 projection with per-row activation scales and per-output-channel weight scales, output bf16:

    out[t, n] = (sum_k x[t, k] * w[n, k]) * x_scale[t] * w_scale[n] (+ bias[n])      accumulated in float32

for the decoder's residual projections (o and down), whose output is added to the residual stream. On a CUDA GPU
with FP8 tensor cores this is cuBLAS's ``torch._scaled_mm`` with rowwise scales (the scales are applied in its
epilogue); elsewhere the plain-torch reference, which computes the same sum in float32. Triton's own FP8 GEMMs
(with the SwiGLU or the q/k norm and rotary in their epilogue) are ``swiglu_matmul`` and ``qkv_rope_matmul``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rerankit.kernels import cuda_capability
from rerankit.kernels.fp8_quant import FP8_DTYPE

SCALED_MM_MULTIPLE = 16  # cuBLAS's FP8 GEMM takes K and N in multiples of 16
# cuBLAS's fast accumulation, off: on Hopper the FP8 tensor cores accumulate in reduced precision, and cuBLAS adds
# their partial sums into float32 every few steps unless asked not to (Triton's FP8 dots, the SwiGLU and q/k/v
# GEMMs, never do: max_num_imprecise_acc is 2^30 on compute capability 9.0). H100, 2026-11-27,
# ``benchmarks/fp8_accumulation.py`` (both settings in one process, alternating): 4B 453.4 pairs/s off, 454.1 on;
# 8B 269.9 off, 269.8 on. No speed to gain for the precision.
FAST_ACCUM = False


def _check(x: Tensor, x_scale: Tensor, weight: Tensor, w_scale: Tensor, bias: Tensor | None) -> None:
    if x.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
        raise ValueError(f"x and weight must be {FP8_DTYPE}, got {x.dtype} and {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [T, d] and weight [N, d], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x_scale.shape != (x.shape[0],) or w_scale.shape != (weight.shape[0],):
        raise ValueError(f"x_scale must be [{x.shape[0]}] and w_scale [{weight.shape[0]}], got "
                         f"{tuple(x_scale.shape)} and {tuple(w_scale.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def fp8_matmul_reference(x: Tensor, x_scale: Tensor, weight: Tensor, w_scale: Tensor, bias: Tensor | None = None,
                         out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Plain torch: the codes' products summed in float32 (exact products: e4m3 x e4m3 fits float32), then the
    scales and the bias in float32, rounded once to ``out_dtype``."""
    _check(x, x_scale, weight, w_scale, bias)
    out = (x.float() @ weight.float().T) * x_scale[:, None] * w_scale[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def project_reference(x: Tensor, weight: Tensor, bias: Tensor | None, x_scale: Tensor | None,
                      w_scale: Tensor | None, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``F.linear`` for 16/32-bit inputs, ``fp8_matmul_reference`` (``out_dtype``) when scales are given: the first
    step of the fused GEMMs' references."""
    if x_scale is None:
        return F.linear(x, weight, bias)
    return fp8_matmul_reference(x, x_scale, weight, w_scale, bias, out_dtype)


def takes_scaled_mm(x: Tensor, weight: Tensor) -> bool:
    """Whether cuBLAS's FP8 GEMM applies: a CUDA GPU with FP8 tensor cores (compute capability 8.9 on) and K and N
    in multiples of 16."""
    return (x.is_cuda and cuda_capability(x.device) >= (8, 9) and x.shape[1] % SCALED_MM_MULTIPLE == 0
            and weight.shape[0] % SCALED_MM_MULTIPLE == 0)


def fp8_matmul(x: Tensor, x_scale: Tensor, weight: Tensor, w_scale: Tensor, bias: Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``x @ weight.T`` of float8_e4m3fn ``x`` [T, d] and ``weight`` [N, d] with their float32 scales ``x_scale``
    [T] and ``w_scale`` [N], ``out_dtype`` [T, N]; the bias is added to the rounded product on the GPU path."""
    if not takes_scaled_mm(x, weight) or x.shape[0] == 0:
        return fp8_matmul_reference(x, x_scale, weight, w_scale, bias, out_dtype)
    _check(x, x_scale, weight, w_scale, bias)
    out = scaled_mm(x.contiguous(), x_scale.contiguous(), weight, w_scale.contiguous(), out_dtype=out_dtype)
    return out if bias is None else out.add_(bias)


def scaled_mm(x: Tensor, x_scale: Tensor, weight: Tensor, w_scale: Tensor, bias: Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """cuBLAS's FP8 GEMM with rowwise scales, unchecked (``fp8_matmul`` checks; ``torch.compile`` traces this
    whole): a ``bias`` goes in its epilogue, added in float32 before the one rounding, as the reference adds it."""
    return torch._scaled_mm(x, weight.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :], bias=bias,
                            out_dtype=out_dtype, use_fast_accum=FAST_ACCUM)
