"""The decoder's FP8 layer: its projections quantized to float8_e4m3fn, everything else in bf16.

Per layer (``PackedDecoder`` with ``fp8``):

    x, sx  = add_rms_norm_quant(hidden, d, input_norm)   the last layer's d added, RMSNorm, per-token amax / 448
                                                         scales, float8 codes: one kernel
    q,k,v  = qkv_rope_matmul(x, Wqkv; sx, sWqkv)         FP8 GEMM, scales, q/k norm and rotary in its epilogue
    b      = max |v|                                     one small kernel: a bound of every |a| (softmax weights
                                                         sum to 1, so a row of a is a convex combination of v's)
    a, sa  = attention(q, k, v; b)                       bf16 inside; float8 codes out, one scale b / 448 a row
    o      = fp8_matmul(a, Wo; sa, sWo)                  cuBLAS's scaled FP8 GEMM, bf16 out
    x, sx, n  = add_rms_norm_quant(hidden, o, post_norm)  hidden += o, RMSNorm, quantization, each row's squared
                                                         length n: one kernel
    h, sh  = swiglu_matmul_fp8_out(x, Wgate_up; sx, sWgate_up; n)
                                                         FP8 GEMM, scales and SwiGLU in its epilogue, float8
                                                         codes out under a bound of each row (n times the
                                                         weight's swiglu_bound)
    d      = fp8_matmul(h, Wdown; sh, sWdown)            added by the next layer's add_rms_norm_quant

$RERANKIT_FP8_PROJECTIONS picks which of the four projections are FP8 (``engine.fp8.projections``: by default
o and down stay bf16 on narrow models, where FP8 saves less than their output's add costs); a bf16 projection
runs as the bf16 engine runs it (o and down accumulate into the residual stream in cuBLAS).

Where down stays bf16 (or gate/up has a bias, or no copy engine runs the fused kernel), the SwiGLU GEMM writes bf16
h, and an FP8 down projection quantizes it per row in a pass.

The o projection's input is scaled by the bound b rather than per row: e4m3 keeps 3 bits of mantissa at any
magnitude, so a scale that only bounds the row costs precision only in rows below b's 2^-15 (subnormals), and
the attention kernel writes the codes itself: no quantization pass, and half the bytes. Attention backends
other than the Triton kernels quantize their bf16 output with the same bound in a pass
(``fp8_quant.quantize_bounded``).

Weights are quantized per output channel (amax / 448) at load, or come as they are from an FP8 checkpoint
(``engine.fp8``). ``KERNELS`` runs the Triton and cuBLAS kernels (a GPU without Hopper's copy engine projects
q/k/v and gate/up through cuBLAS too, then runs ``qk_norm_rope`` and the activation); ``REFERENCE`` runs each
kernel's plain-torch reference (float32 dequantized products), on any device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rerankit.kernels.fp8_matmul import fp8_matmul, fp8_matmul_reference
from rerankit.kernels.fp8_quant import (
    FP8_DTYPE,
    abs_max,
    abs_max_reference,
    add_rms_norm_quant,
    add_rms_norm_quant_reference,
    quantize_bounded,
    quantize_bounded_reference,
    quantize_rows,
    quantize_rows_reference,
    rms_norm_quant,
    rms_norm_quant_reference,
)
from rerankit.kernels.qkv_rope_matmul import qkv_rope_matmul, qkv_rope_matmul_reference
from rerankit.kernels.qkv_rope_matmul import takes_tma as qkv_takes_tma
from rerankit.kernels.rms_norm import rms_norm, rms_norm_reference
from rerankit.kernels.swiglu_matmul import (
    swiglu_bound,
    swiglu_matmul,
    swiglu_matmul_fp8_out,
    swiglu_matmul_fp8_out_reference,
    swiglu_matmul_reference,
)
from rerankit.kernels.swiglu_matmul import takes_tma as swiglu_takes_tma

# The PackedDecoderLayer attribute of each fused projection, and the transformers modules fused into it.
PROJECTIONS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


@dataclass(frozen=True)
class Fp8Ops:
    """The steps of an FP8 layer: the kernels, or their plain-torch references."""

    norm_quant: Callable
    add_norm_quant: Callable
    norm: Callable
    quant: Callable
    matmul: Callable
    swiglu: Callable
    qkv_rope: Callable
    abs_max: Callable
    quant_bounded: Callable
    swiglu_fp8_out: Callable
    kernels: bool


KERNELS = Fp8Ops(rms_norm_quant, add_rms_norm_quant, rms_norm, quantize_rows, fp8_matmul, swiglu_matmul,
                 qkv_rope_matmul, abs_max, quantize_bounded, swiglu_matmul_fp8_out, kernels=True)
REFERENCE = Fp8Ops(rms_norm_quant_reference, add_rms_norm_quant_reference, rms_norm_reference, quantize_rows_reference,
                   fp8_matmul_reference, swiglu_matmul_reference, qkv_rope_matmul_reference, abs_max_reference,
                   quantize_bounded_reference, swiglu_matmul_fp8_out_reference, kernels=False)


def _module(layer: Any, path: str) -> Any:
    """``layer``'s submodule at a dotted ``path``: a transformers module, or a node of a raw checkpoint's tree."""
    for part in path.split("."):
        layer = getattr(layer, part)
    return layer


@torch.no_grad()  # else each scale's autograd graph keeps float32 copies of its weight alive (8 bytes a weight)
def quantize_projection(layer: nn.Module, hf_layer: Any, name: str, paths: tuple[str, ...],
                        given: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Set ``layer``'s projection ``name`` (the transformers modules at ``paths``, fused in order) as float8 codes
    (``<name>_weight``) and float32 scales per output channel (``<name>_scale``): ``given``'s for a module it holds
    (an FP8 checkpoint's, by ``id`` of the module), else quantized from the module's weight. The modules' 16-bit
    weights are released: the packed layer no longer reads them, nor can the transformers model."""
    modules = [_module(hf_layer, path) for path in paths]
    parts = [given.get(id(module)) or quantize_rows_reference(module.weight) for module in modules]
    setattr(layer, f"{name}_weight", nn.Parameter(torch.cat([codes for codes, _ in parts]), requires_grad=False))
    layer.register_buffer(f"{name}_scale", torch.cat([scale for _, scale in parts]), persistent=False)
    for module in modules:
        if isinstance(module.weight, nn.Parameter):
            module.weight.data = module.weight.data.new_empty(0)
        else:  # a raw checkpoint's tensor
            module.weight = module.weight.new_empty(0)


@torch.no_grad()
def quantize_layers(layers: nn.ModuleList, hf_layers: nn.ModuleList,
                    given: dict[int, tuple[torch.Tensor, torch.Tensor]],
                    projections: tuple[str, ...] = tuple(PROJECTIONS)) -> None:
    """Each decoder layer's ``projections`` in float8 (``quantize_projection``); the other projections keep their
    16-bit weights (and run as the bf16 engine runs them)."""
    for layer, hf_layer in zip(layers, hf_layers):
        for name in projections:
            quantize_projection(layer, hf_layer, name, PROJECTIONS[name], given)
            if name == "gate_up":  # what bounds the SwiGLU's products per squared length of x
                layer.gate_up_bound = swiglu_bound(layer.gate_up_weight, layer.gate_up_scale)


def is_fp8_weight(weight: torch.Tensor) -> bool:
    """Whether a layer's projection weight was quantized (float8 codes), or kept 16-bit."""
    return weight.dtype == FP8_DTYPE


def _normed(hidden: torch.Tensor, pending: torch.Tensor | None, norm: torch.Tensor, weight: torch.Tensor, eps: float,
            ops: Fp8Ops, sumsq: bool = False) -> tuple:
    """``pending`` (an FP8 projection's output, or None) added onto ``hidden`` in place, then the RMSNorm as the
    projection ``weight`` takes it: float8 codes and scales (the add, norm and quantization in one kernel; with
    ``sumsq``, the rows' squared lengths too), or bf16 and None."""
    if is_fp8_weight(weight):
        if pending is not None:
            return ops.add_norm_quant(hidden, pending, norm, eps, sumsq=sumsq)
        return ops.norm_quant(hidden, norm, eps, sumsq=sumsq)
    if pending is not None:
        hidden.add_(pending)
    return ops.norm(hidden, norm, eps), None


def attention_inputs(hidden: torch.Tensor, pending: torch.Tensor | None, layer: nn.Module,
                     rope: tuple[torch.Tensor, torch.Tensor], position_ids: torch.Tensor, inv_freq: torch.Tensor,
                     num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                     ops: Fp8Ops) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The previous layer's ``pending`` down projection added onto ``hidden`` (in place), norm, quantization and
    the FP8 q/k/v GEMM with q/k norm and rotary: q, k, v [T, H, D] bf16 (the bf16 GEMM where q/k/v stayed
    16-bit)."""
    x, x_scale = _normed(hidden, pending, layer.input_norm, layer.qkv_weight, eps, ops)
    w_scale = getattr(layer, "qkv_scale", None) if x_scale is not None else None
    if ops.kernels and not qkv_takes_tma(x, layer.qkv_weight, head_dim):  # no copy engine: cuBLAS, then q/k
        from rerankit.kernels.qk_norm_rope import qk_norm_rope

        qkv = fp8_matmul(x, x_scale, layer.qkv_weight, w_scale, layer.qkv_bias) if x_scale is not None else \
            F.linear(x, layer.qkv_weight, layer.qkv_bias)
        q, k = qk_norm_rope(qkv, num_heads, num_kv_heads, head_dim, position_ids, inv_freq, layer.q_norm,
                            layer.k_norm, eps)
        return q, k, qkv[:, (num_heads + num_kv_heads) * head_dim:].unflatten(-1, (num_kv_heads, head_dim))
    qkv = ops.qkv_rope(x, layer.qkv_weight, layer.qkv_bias, num_heads, num_kv_heads, head_dim, *rope, layer.q_norm,
                       layer.k_norm, eps, x_scale=x_scale, w_scale=w_scale)
    heads = qkv.view(qkv.shape[0], -1, head_dim)  # [T, Hq + 2 Hkv, D]: plain slices (split/unflatten cost more host)
    return heads[:, :num_heads], heads[:, num_heads:num_heads + num_kv_heads], heads[:, num_heads + num_kv_heads:]


def o_input_bound(v: torch.Tensor, layer: nn.Module, ops: Fp8Ops,
                  kept: torch.Tensor | None = None) -> torch.Tensor | None:
    """The bound the o projection's input is quantized under, or None where o stays 16-bit: the largest |v| over
    the batch's values and the ``kept`` ones (a kept prefix head's, which the batch's queries also attend to)."""
    if not is_fp8_weight(layer.o_weight):
        return None
    return ops.abs_max(v) if kept is None else ops.abs_max(v, kept)


Attended = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # bf16 [T, H, D], or float8 codes and a scale a row


def residual_projection(hidden: torch.Tensor, x: Attended, layer: nn.Module, name: str, ops: Fp8Ops,
                        bound: torch.Tensor | None = None) -> torch.Tensor | None:
    """The residual projection ``name`` (o or down) of ``x`` [T, d]. A float8 weight: ``x`` quantized per token
    (under ``bound`` where given; ``x`` may come quantized already, as codes and scales), the FP8 GEMM's bf16
    output (+ bias) returned, for the next norm's kernel to add onto ``hidden``. A 16-bit weight: cuBLAS's GEMM
    accumulates into ``hidden`` in place, and None is returned."""
    weight, bias = getattr(layer, f"{name}_weight"), getattr(layer, f"{name}_bias")
    if is_fp8_weight(weight):
        if isinstance(x, tuple):
            codes, scale = x
        else:
            codes, scale = ops.quant(x) if bound is None else ops.quant_bounded(x, bound)
        return ops.matmul(codes, scale, weight, getattr(layer, f"{name}_scale"), bias)
    hidden.addmm_(x, weight.t())
    if bias is not None:
        hidden.add_(bias)
    return None


def quantizes_swiglu(layer: nn.Module) -> bool:
    """Whether the SwiGLU GEMM writes float8 codes for the down projection (``swiglu_matmul_fp8_out``): gate/up
    and down in FP8, and gate/up without a bias (its bound does not cover one)."""
    return is_fp8_weight(layer.gate_up_weight) and is_fp8_weight(layer.down_weight) and layer.gate_up_bias is None


def output_and_mlp(attended: Attended, hidden: torch.Tensor, layer: nn.Module, eps: float, ops: Fp8Ops,
                   bound: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rest of the layer: o projection (of the attention's bf16 output, quantized under ``bound``, or of its
    codes and scales), norm, SwiGLU GEMM, down projection. Returns ``hidden`` (the forward's own tensor, updated in
    place) and the down projection's output still to be added onto it (None when it was): the next layer's norm
    kernel adds it, or the forward after its last layer."""
    rows = (attended[0].flatten(1), attended[1]) if isinstance(attended, tuple) else attended.flatten(1)
    pending = residual_projection(hidden, rows, layer, "o", ops, bound)
    if quantizes_swiglu(layer):  # the SwiGLU GEMM writes the down projection's float8 input itself
        x, x_scale, lengths = _normed(hidden, pending, layer.post_norm, layer.gate_up_weight, eps, ops, sumsq=True)
        if not ops.kernels or swiglu_takes_tma(x, layer.gate_up_weight):
            activated = ops.swiglu_fp8_out(x, layer.gate_up_weight, x_scale, layer.gate_up_scale, lengths,
                                           layer.gate_up_bound)
            return hidden, residual_projection(hidden, activated, layer, "down", ops)
    else:
        x, x_scale = _normed(hidden, pending, layer.post_norm, layer.gate_up_weight, eps, ops)
    w_scale = getattr(layer, "gate_up_scale", None) if x_scale is not None else None
    if ops.kernels and not swiglu_takes_tma(x, layer.gate_up_weight):  # no copy engine: cuBLAS, then the activation
        projected = fp8_matmul(x, x_scale, layer.gate_up_weight, w_scale, layer.gate_up_bias) \
            if x_scale is not None else F.linear(x, layer.gate_up_weight, layer.gate_up_bias)
        gate, up = projected.chunk(2, -1)
        activated = (F.silu(gate.float()) * up.float()).to(hidden.dtype)
    else:
        activated = ops.swiglu(x, layer.gate_up_weight, layer.gate_up_bias, x_scale=x_scale, w_scale=w_scale)
    return hidden, residual_projection(hidden, activated, layer, "down", ops)
