"""The encoder's FP8 block (``PackedEncoder`` with ``fp8``): its four projections in float8_e4m3fn, the rest in bf16.

Per block (post-LayerNorm, as BERT and XLM-R):

    x, sx  = quantize(hidden)                          per token: amax / 448 scales, float8 codes
    q,k,v  = project(x, Wqkv; sx, sWqkv) + bqkv        FP8 GEMM, float32 accumulation, bf16 out
    a      = attention(q, k, v)                        bf16
    hidden = LayerNorm(project(quantize(a), Wo) + bo + hidden)
    x, sx  = quantize(hidden)                          and |x| of each dequantized row
    inner  = GELU(project(x, Wup; sx, sWup) + bup)     codes under the bound max(|x| max_n |w_n| + max |b|, 0.17)
    hidden = LayerNorm(project(inner, Wdown) + bdown + hidden)

The feed-forward's inner activations are quantized under a bound known before them, not their rows' largest value
(the decoder's SwiGLU GEMM does the same, ``kernels.swiglu_matmul``): by Cauchy-Schwarz |u_n| <= |x| |w_n| + |b_n|,
and GELU's output lies within max(|u|, 0.17). So the GELU and the quantization are one pointwise pass over [T, 4d]
with no reduction before it (``kernels.gelu_quant``; a row's amax had Inductor read the GELU's input twice, a looped
reduction over 4,096 columns then the codes: 8.0 of 34.6 ms of GPU time on a BERT-large call of 100 documents,
H100). e4m3 keeps its 3 bits of mantissa down to 2^-15 of the bound, so a bound some ten times a row's largest value
costs precision only in its smallest values (subnormal codes).

Weights are quantized once at load, one float32 scale per output channel (row amax / 448), or taken from an FP8
checkpoint; activations per token, right before each GEMM, as the decoder's are (``kernels.fp8_quant``). On a GPU
the GEMMs are cuBLAS's ``torch._scaled_mm`` with rowwise scales, and each step runs through ``torch.compile``, so
Inductor fuses each other quantization with the LayerNorm before it (one pass writes both the bf16 residual and the
codes). Elsewhere, or with $RERANKIT_FP8_REFERENCE=1, the GEMMs are ``fp8_matmul_reference``'s float32 sums of
the codes' products. Embeddings, LayerNorms, attention and the classification head stay bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rerankit.engine.models.fp8 import quantize_projection
from rerankit.kernels.fp8_matmul import fp8_matmul_reference, scaled_mm
from rerankit.kernels.fp8_quant import quantize_rows_reference, squared_lengths
from rerankit.kernels.gelu_quant import gelu_codes, gelu_codes_reference

# The fused attribute of ``PackedEncoderLayer`` each projection sets, and the transformers modules fused into it.
PROJECTIONS = {
    "qkv": ("attention.self.query", "attention.self.key", "attention.self.value"),
    "o": ("attention.output.dense",),
    "up": ("intermediate.dense",),
    "down": ("output.dense",),
}

Matmul = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
GeluCodes = Callable[[Tensor, Tensor, Tensor, Tensor, str], tuple[Tensor, Tensor]]


@torch.no_grad()
def quantize_layer(layer: nn.Module, hf_layer: Any, given: dict[int, tuple[Tensor, Tensor]]) -> None:
    """``layer``'s four projections in float8 (``models.fp8.quantize_projection``: codes and scales per output
    channel, ``given``'s where an FP8 checkpoint had them), and ``up_bound``: the up weight's largest row length and
    its bias's largest |b|, which bound the GELU's input per length of x."""
    for name, paths in PROJECTIONS.items():
        quantize_projection(layer, hf_layer, name, paths, given)
    lengths = layer.up_weight.float().square().sum(-1).sqrt() * layer.up_scale  # each dequantized row's |w_n|
    layer.register_buffer("up_bound", torch.stack([lengths.max(), layer.up_bias.float().abs().max()]),
                          persistent=False)  # a tensor: floats would make torch.compile specialize on each layer


def reference_matmul(codes: Tensor, scale: Tensor, weight: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    """The float32 sum of the codes' products, scaled, plus the bias, rounded once to bf16."""
    return fp8_matmul_reference(codes, scale, weight, w_scale, bias)


def attention_inputs(hidden: Tensor, qkv_weight: Tensor, qkv_scale: Tensor, qkv_bias: Tensor, num_heads: int,
                     head_dim: int, matmul: Matmul) -> tuple[Tensor, Tensor, Tensor]:
    """The fused q/k/v projection of the quantized ``hidden``, split into heads [T, H, D] (bf16). Its bias is added in
    the GEMM's epilogue: added apart, it took a pass of its own over q/k/v (3.2 of 34.6 ms of GPU time on a BERT-large
    call of 100 documents, H100), where the other projections' biases join the kernels Inductor fuses after them
    (the epilogue's bias slowed cuBLAS's FP8 GEMMs by 1.6 ms in all on that call)."""
    codes, scale = quantize_rows_reference(hidden)
    q, k, v = matmul(codes, scale, qkv_weight, qkv_scale, qkv_bias).view(-1, 3, num_heads, head_dim).unbind(1)
    return q, k, v


def attention_output_and_ffn(attention: Tensor, hidden: Tensor, o_weight: Tensor, o_scale: Tensor, o_bias: Tensor,
                             attention_norm_weight: Tensor, attention_norm_bias: Tensor, up_weight: Tensor,
                             up_scale: Tensor, up_bias: Tensor, up_bound: Tensor, down_weight: Tensor,
                             down_scale: Tensor, down_bias: Tensor, output_norm_weight: Tensor,
                             output_norm_bias: Tensor, eps: float, approximate: str, matmul: Matmul,
                             gelu: GeluCodes) -> Tensor:
    """The rest of one block: FP8 output projection, residual, LayerNorm, FP8 GELU feed-forward, residual,
    LayerNorm (tensors passed one by one, as the bf16 step takes them: ``torch.compile`` then traces it once for
    every layer)."""
    size = hidden.shape[-1:]
    codes, scale = quantize_rows_reference(attention.flatten(1))
    projected = matmul(codes, scale, o_weight, o_scale, None) + o_bias
    hidden = F.layer_norm(projected + hidden, size, attention_norm_weight, attention_norm_bias, eps)
    codes, scale = quantize_rows_reference(hidden)
    lengths = squared_lengths(codes, scale).sqrt()
    codes, scale = gelu(matmul(codes, scale, up_weight, up_scale, None), up_bias, lengths, up_bound, approximate)
    projected = matmul(codes, scale, down_weight, down_scale, None) + down_bias
    return F.layer_norm(projected + hidden, size, output_norm_weight, output_norm_bias, eps)


# The GEMM and the activation the steps take: on a GPU cuBLAS's and the Triton kernel's (a Triton op that Inductor
# launches from the compiled step), else (or with $RERANKIT_FP8_REFERENCE=1) their float32 references.
GPU_STEPS = (scaled_mm, gelu_codes)
REFERENCE_STEPS = (reference_matmul, gelu_codes_reference)
