"""Per-row FP8 quantization, alone or fused with the RMSNorm that precedes a projection.

    scale[t] = max(|x[t, :]|) / 448          (float32; 448 is float8_e4m3fn's largest finite value)
    q[t, :]  = (x[t, :] * (448 / max(|x[t, :]|))) as float8_e4m3fn  (round to nearest even)

so ``q * scale`` gives ``x`` back to within e4m3's 3-bit mantissa. Activations are quantized this way per token
right before each FP8 GEMM (dynamic: the scale comes from the row itself); weights per output channel at load time
(a weight's rows are its output channels). ``rms_norm_quant`` first normalises the row exactly as ``rms_norm``
does (statistics in float32, the scale and the weight applied in the input dtype), so the quantized row is that
of the bf16 row the bf16 engine would project. With ``sumsq=True`` the norm kernels also give each quantized row's
squared length, ``scale[t]^2 * sum(q[t, :]^2)``: what a bound of the next projection's outputs is built from
(``swiglu_matmul``'s FP8 output). The kernel runs on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1;
anything else falls back to the reference.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from rerankit.kernels.direct_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still serves machines without triton
    triton = None

_INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12  # an all-zero row gets a tiny scale instead of a division by zero; its codes stay zero
_TILE_ELEMENTS = 4096  # elements a program holds, as in rms_norm
_MAX_BLOCK = 16384  # elements an abs_max program reads (fewer atomics on its one address)


# (codes, scales), or (codes, scales, squared lengths) where asked for
Quantized = tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]


def check_scaled(x: Tensor, weight: Tensor, x_scale: Tensor | None, w_scale: Tensor | None) -> None:
    """``ValueError`` unless ``x`` and ``weight`` share a dtype and come with both scales exactly when float8."""
    if (x.dtype == FP8_DTYPE) != (x_scale is not None and w_scale is not None) or weight.dtype != x.dtype:
        raise ValueError(f"float8 x and weight take x_scale and w_scale, other dtypes neither; got {x.dtype} x, "
                         f"{weight.dtype} weight, scales {x_scale is not None} / {w_scale is not None}")


def quantize_rows_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    """Plain torch: each row of ``x`` [T, d] as float8_e4m3fn codes [T, d] and its float32 scale [T]."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1).clamp(min=MIN_AMAX)
    return (x32 * _divided(torch.full_like(amax, FP8_MAX), amax)[:, None]).to(FP8_DTYPE), _divided(amax, FP8_MAX)


def _divided(dividend: Tensor, divisor: Tensor | float) -> Tensor:
    """``dividend / divisor`` rounded once, as the kernels' ``div_rn``: torch's ``float / tensor`` is the tensor's
    reciprocal times the float, and on CUDA ``tensor / float`` is the tensor times the float's reciprocal, two
    roundings each (448 / 12 came out a unit in the last place high)."""
    return torch.div(dividend, divisor if isinstance(divisor, Tensor) else torch.full_like(dividend, divisor))


def squared_lengths(codes: Tensor, scale: Tensor) -> Tensor:
    """float32 [T]: each quantized row's squared length, ``scale^2 * sum(codes^2)`` (the codes' squares summed in
    float32; the kernels' order of summation may differ in the last bits)."""
    return codes.float().square().sum(-1) * (scale * scale)


def rms_norm_quant_reference(x: Tensor, weight: Tensor, eps: float, sumsq: bool = False) -> Quantized:
    """Plain torch: the decoder's ``rms_norm``, then ``quantize_rows_reference`` (and ``squared_lengths``)."""
    from rerankit.engine.models.layers import rms_norm  # at call time: kernels do not depend on the engine

    codes, scale = quantize_rows_reference(rms_norm(x, weight, eps))
    return (codes, scale, squared_lengths(codes, scale)) if sumsq else (codes, scale)


def add_rms_norm_quant_reference(x: Tensor, delta: Tensor, weight: Tensor, eps: float,
                                 sumsq: bool = False) -> Quantized:
    """Plain torch: ``x += delta`` in place (the residual add, rounded to x's dtype), then
    ``rms_norm_quant_reference`` of the sum."""
    return rms_norm_quant_reference(x.add_(delta), weight, eps, sumsq)


def abs_max_reference(*tensors: Tensor) -> Tensor:
    """Plain torch: the largest |x| over every element of ``tensors`` (at least MIN_AMAX), float32 [1]."""
    bound = torch.full((1,), MIN_AMAX, dtype=torch.float32, device=tensors[0].device)
    for x in tensors:
        if x.numel():
            bound = torch.maximum(bound, x.float().abs().amax().reshape(1))
    return bound


def quantize_bounded_reference(x: Tensor, bound: Tensor) -> tuple[Tensor, Tensor]:
    """Plain torch: the rows of ``x`` [T, d] quantized with the scale ``bound / 448``, where ``bound`` (float32) is
    a bound of |x| known beforehand: one for every row ([1], such as the largest |v| for an attention output) or
    one a row ([T]); codes [T, d], scales [T]."""
    x32 = x.float()
    factor = _divided(torch.full_like(bound, FP8_MAX), bound).reshape(-1, 1)
    codes = (x32 * factor).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, _divided(bound, FP8_MAX).expand(x.shape[0]).contiguous()


def abs_max(*tensors: Tensor) -> Tensor:
    """``abs_max_reference`` of ``tensors`` (each [T, ...]) in a Triton launch each, rows read with their stride (a
    slice of a projection's columns, such as v, is read in place); each program's maximum joins the one result by
    an atomic max."""
    bound = torch.full((1,), MIN_AMAX, dtype=torch.float32, device=tensors[0].device)
    for x in tensors:
        rows = x.flatten(1) if x.dim() > 1 else x[:, None]
        if triton is None or not (x.is_cuda or _INTERPRET) or rows.stride(-1) != 1:
            bound = torch.maximum(bound, abs_max_reference(x))
            continue
        count, width = rows.shape
        if count and width:
            block_d = triton.next_power_of_2(width)
            block_t = max(1, min(_MAX_BLOCK // block_d, triton.next_power_of_2(count)))
            launch(_abs_max_kernel, (triton.cdiv(count, block_t),), rows, bound, count, width, rows.stride(0),
                   BLOCK_T=block_t, BLOCK_D=block_d)
    return bound


def quantize_bounded(x: Tensor, bound: Tensor) -> tuple[Tensor, Tensor]:
    """``quantize_bounded_reference`` in one Triton launch."""
    return _launch(x, None, 0.0, bound=bound)


def dequantize_rows(codes: Tensor, scale: Tensor) -> Tensor:
    """float32 ``codes * scale`` per row: what a quantized row stands for."""
    return codes.float() * scale[:, None]


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``quantize_rows_reference`` in one Triton launch (codes [T, d] float8_e4m3fn, scales [T] float32)."""
    return _launch(x, None, 0.0)


def rms_norm_quant(x: Tensor, weight: Tensor, eps: float, sumsq: bool = False) -> Quantized:
    """RMSNorm of each row of ``x`` [T, d] with ``weight`` [d], quantized per row, in one Triton launch: the
    normalised bf16 row never goes to memory. ``sumsq``: each quantized row's squared length too."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm_quant takes x [T, d] and weight [d], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    return _launch(x, weight, eps, sumsq=sumsq)


def add_rms_norm_quant(x: Tensor, delta: Tensor, weight: Tensor, eps: float, sumsq: bool = False) -> Quantized:
    """``x += delta`` in place (a residual stream and a projection's output, [T, d]), then ``rms_norm_quant`` of
    the sum, in one Triton launch: the add's own pass (read both, write x) folds into the norm's read."""
    if delta.shape != x.shape or weight.shape != (x.shape[-1],):
        raise ValueError(f"add_rms_norm_quant takes x and delta [T, d] and weight [d], got {tuple(x.shape)}, "
                         f"{tuple(delta.shape)} and {tuple(weight.shape)}")
    if x.stride(-1) != 1 or delta.stride(-1) != 1:
        raise ValueError("add_rms_norm_quant updates x in place: x and delta need contiguous rows")
    return _launch(x, weight, eps, delta, sumsq=sumsq)


def _launch(x: Tensor, weight: Tensor | None, eps: float, delta: Tensor | None = None,
            bound: Tensor | None = None, sumsq: bool = False) -> Quantized:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, d], got {tuple(x.shape)}")
    if triton is None or not (x.is_cuda or _INTERPRET) or (weight is not None and weight.dtype != x.dtype) \
            or (delta is not None and delta.dtype != x.dtype):
        if bound is not None:
            return quantize_bounded_reference(x, bound)
        if delta is not None:
            return add_rms_norm_quant_reference(x, delta, weight, eps, sumsq)
        return quantize_rows_reference(x) if weight is None else rms_norm_quant_reference(x, weight, eps, sumsq)
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, width = x.shape
    codes = torch.empty(rows, width, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    lengths = torch.empty(rows, dtype=torch.float32, device=x.device) if sumsq else scale
    if rows == 0:
        return (codes, scale, lengths) if sumsq else (codes, scale)
    block_d = triton.next_power_of_2(width)
    block_t = max(1, min(_TILE_ELEMENTS // block_d, triton.next_power_of_2(rows)))
    launch(
        _quantize_kernel, (triton.cdiv(rows, block_t),),
        x, x if weight is None else weight, x if delta is None else delta, codes, scale,
        scale if bound is None else bound, lengths, rows, width, x.stride(0), 0 if delta is None else delta.stride(0),
        eps, NORM=weight is not None, ADD=delta is not None, BOUNDED=bound is not None, SUMSQ=sumsq,
        ROUND_FIRST=_INTERPRET, BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=4 if block_d <= 2048 else 8,
    )
    return (codes, scale, lengths) if sumsq else (codes, scale)


if triton is not None:
    _MAX = tl.constexpr(FP8_MAX)  # kernels read module globals only as constexprs
    _MIN_AMAX = tl.constexpr(MIN_AMAX)

    @triton.jit
    def _round_to_e4m3(v):
        """``v`` (float32, |v| <= 448) rounded to the nearest e4m3 value (ties to even), still in float32: adding
        and subtracting 1.5 x 2^23 units of the e4m3 step at v's binade rounds in float32's own arithmetic. The
        interpreter's float8 cast truncates and does not carry a round-up into the exponent (127.6 became 64, not
        128); on values already on the grid it is exact. The GPU's cast rounds correctly by itself."""
        exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        step = tl.maximum(exponent, -6) - 3  # e4m3: 3 mantissa bits; below 2^-6 subnormals with a step of 2^-9
        magic = (((step + 150) << 23) | (1 << 22)).to(tl.float32, bitcast=True)  # 1.5 * 2^(23 + step)
        return (v + magic) - magic

    @triton.jit
    def bounded_scale(bound):
        """The one scale of codes under ``bound`` (a float32 scalar): ``bound / 448``, rounded once."""
        return tl.math.div_rn(bound.to(tl.float32), tl.full([], _MAX, tl.float32))

    @triton.jit
    def bounded_codes(x32, bound, ROUND_FIRST: tl.constexpr):
        """``x32 * (448 / bound)`` within +-448, rounded to e4m3 (still float32: the caller casts), as
        ``quantize_bounded_reference`` computes it; ``bound`` is a float32 scalar."""
        # float32 operands throughout: the interpreter would divide a scalar in float64 (and round ties off)
        scaled = x32 * tl.math.div_rn(tl.full([], _MAX, tl.float32), bound.to(tl.float32))
        scaled = tl.minimum(tl.maximum(scaled, -_MAX), _MAX).to(tl.float32)
        if ROUND_FIRST:
            scaled = _round_to_e4m3(scaled)
        return scaled

    @triton.jit
    def _abs_max_kernel(x_ptr, bound_ptr, n_rows, width, stride_x, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """BLOCK_T rows' largest |x|, joined into ``bound`` by an atomic max."""
        rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        mask = (rows < n_rows)[:, None] & (cols < width)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        tl.atomic_max(bound_ptr, tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0))

    @triton.jit
    def _quantize_kernel(x_ptr, weight_ptr, delta_ptr, codes_ptr, scale_ptr, bound_ptr, sumsq_ptr, n_rows, width,
                         stride_x, stride_d, eps, NORM: tl.constexpr, ADD: tl.constexpr, BOUNDED: tl.constexpr,
                         SUMSQ: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_D: tl.constexpr):
        """BLOCK_T rows: load, (add ``delta`` and store the sum back, rounded as torch's add rounds it,) (RMSNorm
        as rms_norm rounds it,) row amax, scale, float8 codes, store. ``BOUNDED``: one scale for every row, from
        ``bound`` (``quantize_bounded``). ``SUMSQ``: each row's squared length after quantization too.
        ``ROUND_FIRST``: round to e4m3 in float32 before the cast (the interpreter's cast does not round)."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_D)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & (cols < width)[None, :]
        rows = rows.to(tl.int64)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        if ADD:
            delta = tl.load(delta_ptr + rows[:, None] * stride_d + cols[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)
            tl.store(x_ptr + rows[:, None] * stride_x + cols[None, :], x, mask=mask)
        if NORM:
            x32 = x.to(tl.float32)
            inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=1) / width + eps)
            normed = (x32 * inv_rms[:, None]).to(x.dtype)
            weight = tl.load(weight_ptr + cols, mask=cols < width, other=0.0)
            x = (weight[None, :].to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
        x32 = x.to(tl.float32)
        if BOUNDED:
            bound = tl.load(bound_ptr)
            scale = tl.zeros([BLOCK_T], dtype=tl.float32) + bounded_scale(bound)
            scaled = bounded_codes(x32, bound, ROUND_FIRST)
        else:
            # Two IEEE divisions a row, then products (exact IEEE on any device): the GPU's `/` is an approximate
            # division (a last bit off at times), and a correctly rounded one per element took 4x the pass's time.
            amax = tl.maximum(tl.max(tl.abs(x32), axis=1), _MIN_AMAX)
            scale = tl.math.div_rn(amax, _MAX)
            scaled = x32 * tl.math.div_rn(_MAX, amax)[:, None]
            if ROUND_FIRST:
                scaled = _round_to_e4m3(scaled)
        codes = scaled.to(codes_ptr.dtype.element_ty)
        tl.store(codes_ptr + rows[:, None] * width + cols[None, :], codes, mask=mask)
        tl.store(scale_ptr + rows, scale, mask=row_ok)
        if SUMSQ:
            exact = codes.to(tl.float32)  # e4m3 values are exact in float32
            tl.store(sumsq_ptr + rows, tl.sum(exact * exact, axis=1) * (scale * scale), mask=row_ok)
