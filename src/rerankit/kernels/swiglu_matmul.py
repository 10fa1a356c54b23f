"""The gate/up projection of a SwiGLU MLP with the activation in its epilogue: ``silu(x @ Wg.T) * (x @ Wu.T)``.

The decoder keeps gate and up fused in one weight ``[2I, d]`` (gate rows first). cuBLAS writes the whole ``[T, 2I]``
projection and a second kernel reads it back to write ``[T, I]``: for Qwen3-0.6B's I = 3,072 that is 30 KB a token
a layer, the largest share of the "elementwise" time in W1's profile. Here a program computes the gate and the up
tile of the same columns from the same x tile, applies the activation in registers and writes only ``[T, I]``.

Rounding follows the torch path (``F.linear`` then Inductor's fused ``silu(gate) * up``): each projection is rounded
to the activation dtype, then silu and the product run in float32 and round once at the store.

Two kernels:
- **Tensor descriptors** (Hopper's copy engine; rows of 16-byte multiples), persistent (one program per SM walking
  the tiles). The weight is read as ``[2, I, d]``: one copy brings the gate and the up tile of the same columns,
  and one ``[128, 2 x 128]`` dot computes both. H100, ``benchmarks/swiglu_matmul.py``, Qwen3-0.6B's MLP (d=1,024,
  I=3,072) at 5k / 14k / 27k tokens: 0.111 / 0.270 / 0.539 ms (582 / 645 / 621 TFLOP/s), cuBLAS's GEMM alone
  0.101 / 0.255 / 0.537 ms, cuBLAS + Inductor's activation 1.44-1.53x slower. Against cuBLAS + Inductor at the 4B
  shape (d=2,560) 1.10-1.26x, at 8B (d=4,096) 1.00-1.14x. The kernel before it (two 128 x 64 accumulators, one
  program per tile) ran 0.122 / 0.324 / 0.619 ms on the 0.6B shape.
- **Pointers** (any shape, any GPU): two accumulators, one program per tile; 469-479 TFLOP/s on the 0.6B shape.

**FP8** (``x`` and the weight float8_e4m3fn, with per-row ``x_scale`` and per-output-channel ``w_scale``, output
bf16): the descriptor kernel only (Hopper on, or the interpreter). FP8 tiles feed ``tl.dot`` with a float32
accumulator, the scales multiply it in the epilogue before the bias and the activation; tiles 128 deep in K (one
byte an element: the same shared memory as the 16-bit kernel's 64). Where it does not apply (no copy engine: Ada)
``swiglu_matmul`` computes the reference. ``swiglu_matmul_fp8_out`` gives float8 codes instead, for an FP8 down
projection: each row quantized in the epilogue under a bound known before the GEMM (see its docstring).

The Triton kernels run on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1; anything else falls back to
``swiglu_matmul_reference``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from rerankit.kernels import cuda_capability, launch_tuned, run_gluon, sm_count
from rerankit.kernels.fp8_matmul import project_reference
from rerankit.kernels.fp8_quant import FP8_DTYPE, MIN_AMAX, check_scaled, quantize_bounded_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still serves machines without triton
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older triton: the pointer kernel only
    TensorDescriptor = None

# Triton decides at decoration time whether a kernel is interpreted, so read the flag at the same moment.
_INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_ENV = "RERANKIT_SWIGLU_KERNEL"  # "triton": FP8 GEMMs skip the warp-specialized kernel (an A/B's other side)


def _warp_specialized(x: Tensor, weight: Tensor, bias: Tensor | None, x_scale: Tensor, w_scale: Tensor,
                      quant: tuple[Tensor, float] | None = None):
    """The FP8 GEMM through the warp-specialized Gluon kernel (``swiglu_ws``) where it takes the call, else None."""
    if not x.is_cuda or os.environ.get(KERNEL_ENV) == "triton":
        return None
    from rerankit.kernels import swiglu_ws  # Gluon's import: only where it may run

    if not swiglu_ws.takes_ws(x, weight, bias):
        return None
    return run_gluon("SwiGLU GEMM", lambda: swiglu_ws.swiglu_ws(x, weight, x_scale, w_scale, quant))


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, x_scale: Tensor | None = None,
           w_scale: Tensor | None = None) -> None:
    check_scaled(x, weight, x_scale, w_scale)
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be [T, d] and weight [2I, d], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1] or weight.shape[0] % 2:
        raise ValueError(f"weight must be [2I, {x.shape[1]}] (gate rows, then up rows), got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def swiglu_matmul_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None, x_scale: Tensor | None = None,
                            w_scale: Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Plain torch: the fused projection (FP8: ``fp8_matmul_reference`` in ``out_dtype``), split into gate and up,
    ``silu(gate) * up`` (the decoder's ``swiglu``)."""
    _check(x, weight, bias, x_scale, w_scale)
    projected = project_reference(x, weight, bias, x_scale, w_scale, out_dtype)
    gate, up = projected.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(projected.dtype)


def swiglu_matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, tma: bool | None = None,
                  x_scale: Tensor | None = None, w_scale: Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``silu(x @ Wg.T + bg) * (x @ Wu.T + bu)`` [T, I] for ``weight`` = [Wg; Wu] [2I, d] and ``bias`` [2I].

    ``tma``: load and store the tiles through tensor descriptors (Hopper's copy engine) instead of pointer
    arithmetic; None picks them where they apply (see ``takes_tma``). FP8 ``x`` and ``weight`` take their float32
    scales ``x_scale`` [T] and ``w_scale`` [2I] and give ``out_dtype``; they run through descriptors only.
    """
    fp8 = x.dtype == FP8_DTYPE
    if fp8 and tma is False:
        raise ValueError("float8 inputs run through tensor descriptors only (tma=None or True)")
    if triton is None or not (x.is_cuda or _INTERPRET) or (fp8 and tma is None and not takes_tma(x, weight)):
        # the reference checks its inputs the same way
        return swiglu_matmul_reference(x, weight, bias, x_scale, w_scale, out_dtype)
    _check(x, weight, bias, x_scale, w_scale)
    x, weight = x.contiguous(), weight.contiguous()
    if fp8 and out_dtype == torch.bfloat16 and (ws := _warp_specialized(x, weight, bias, x_scale, w_scale)) is not None:
        return ws
    tokens, width = x.shape[0], weight.shape[0] // 2
    out = torch.empty(tokens, width, dtype=out_dtype if fp8 else x.dtype, device=x.device)
    if tokens == 0:
        return out
    if tma is None:
        tma = takes_tma(x, weight)
    elif tma and not takes_tma(x, weight, any_device=True):
        raise ValueError(f"tensor descriptors need d and I multiples of {16 // x.element_size()} (16-byte rows), "
                         f"got d={x.shape[1]}, I={width}")
    elif tma and x.is_cuda and x.element_size() != 2 and not fp8:
        raise ValueError(f"the descriptor kernel's tiles are sized for 16-bit (or float8) inputs, not {x.dtype}")
    bias_arg = bias if bias is not None else out
    if tma:
        scales = (x_scale.float().contiguous(), w_scale.float().contiguous()) if fp8 else (out, out)
        _launch_tma(x, weight, bias, scales, out)
        return out
    grid = lambda meta: (triton.cdiv(tokens, meta["BLOCK_M"]) * triton.cdiv(width, meta["BLOCK_N"]),)  # noqa: E731
    args = (x, weight, bias_arg, out, tokens, width, x.shape[1])
    if _INTERPRET:
        _swiglu_matmul_kernel_interpreted[grid](*args, HAS_BIAS=bias is not None)
    else:
        launch_tuned(_swiglu_matmul_kernel, (width, x.shape[1], x.dtype, bias is not None), grid, args,
                     dict(HAS_BIAS=bias is not None), lambda config: None, tokens)
    return out


def swiglu_matmul_fp8_out_reference(x: Tensor, weight: Tensor, x_scale: Tensor, w_scale: Tensor, lengths: Tensor,
                                    bound: float) -> tuple[Tensor, Tensor]:
    """Plain torch: ``swiglu_matmul_reference``'s products in float32 (the projections rounded to bf16, silu(gate)
    * up not rounded), row t quantized to float8_e4m3fn under the bound ``bound * lengths[t]``."""
    _check(x, weight, None, x_scale, w_scale)
    gate, up = project_reference(x, weight, None, x_scale, w_scale, torch.bfloat16).chunk(2, dim=-1)
    row_bounds = (lengths.float() * torch.tensor(bound, dtype=torch.float32)).clamp(min=MIN_AMAX)
    return quantize_bounded_reference(F.silu(gate.float()) * up.float(), row_bounds)


def swiglu_matmul_fp8_out(x: Tensor, weight: Tensor, x_scale: Tensor, w_scale: Tensor, lengths: Tensor,
                          bound: float) -> tuple[Tensor, Tensor]:
    """The FP8 SwiGLU GEMM (bias-free) with float8_e4m3fn output for the down projection: codes [T, I] and a scale
    a row [T], the products of row t quantized under ``bound * lengths[t]`` in the epilogue, so no pass reads them
    back to find each row's largest value.

    ``lengths`` [T] are the rows' squared lengths (``rms_norm_quant(..., sumsq=True)``) and ``bound`` the weight's
    ``swiglu_bound``: by Cauchy-Schwarz |gate| <= |x| |w_gate| and |up| <= |x| |w_up|, and |silu(g)| <= |g|, so
    |silu(gate) * up| <= |x|^2 max_n |w_gate,n| |w_up,n|. e4m3 keeps 3 bits of mantissa over 2^15 below its
    largest value, so a bound some hundred times the row's largest product costs precision only in its smallest
    ones (subnormal codes, an absolute error below 2^-10 of the bound's scale). Descriptor kernel where it applies,
    else the reference."""
    if triton is None or not (x.is_cuda or _INTERPRET) or not takes_tma(x, weight):
        return swiglu_matmul_fp8_out_reference(x, weight, x_scale, w_scale, lengths, bound)
    _check(x, weight, None, x_scale, w_scale)
    x, weight = x.contiguous(), weight.contiguous()
    if (ws := _warp_specialized(x, weight, None, x_scale, w_scale, (lengths, bound))) is not None:
        return ws
    tokens, width = x.shape[0], weight.shape[0] // 2
    codes = torch.empty(tokens, width, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(tokens, dtype=torch.float32, device=x.device)
    if tokens:
        _launch_tma(x, weight, None, (x_scale.float().contiguous(), w_scale.float().contiguous()), codes,
                    (lengths.float().contiguous(), scale, bound))
    return codes, scale


def swiglu_bound(weight: Tensor, w_scale: Tensor) -> float:
    """``max_n |w_gate,n| |w_up,n|`` of a float8 gate/up weight [2I, d] with its scales [2I] (its rows'
    dequantized lengths): ``swiglu_matmul_fp8_out``'s bound per squared length of x, a float32 value."""
    lengths = weight.float().square().sum(-1).sqrt() * w_scale.float()
    gate, up = lengths.chunk(2)
    return float((gate * up).max().to(torch.float32))


def _launch_tma(x: Tensor, weight: Tensor, bias: Tensor | None, scales: tuple[Tensor, Tensor], out: Tensor,
                quant: tuple[Tensor, Tensor, float] | None = None) -> None:
    """The persistent descriptor kernel into ``out``; ``quant`` (rows' squared lengths, their scales' output, the
    bound) for float8 output."""
    tokens, width = x.shape[0], weight.shape[0] // 2
    # Block shapes are set per tuning config by _set_block_shapes; the ones given here are placeholders.
    x_desc, out_desc = (TensorDescriptor.from_tensor(t, [16, 16]) for t in (x, out))
    w_desc = TensorDescriptor.from_tensor(weight.view(2, width, x.shape[1]), [2, 16, 16])
    programs = sm_count(x.device, interpreted=4)  # the persistent kernel: one program per SM
    grid = lambda meta: (min(programs, triton.cdiv(tokens, meta["BLOCK_M"])  # noqa: E731
                             * triton.cdiv(width, meta["BLOCK_N"])),)
    lengths, out_scale, bound = quant if quant is not None else (out, out, 0.0)
    args = (x_desc, w_desc, bias if bias is not None else out, *scales, out_desc, lengths, out_scale, bound, tokens,
            width, x.shape[1])
    fp8 = x.dtype == FP8_DTYPE
    meta = dict(HAS_BIAS=bias is not None, SCALED=fp8, QUANT_OUT=quant is not None, ROUND_FIRST=_INTERPRET,
                NUM_SMS=programs)
    if _INTERPRET:
        _swiglu_tma_kernel_interpreted[grid](*args, **meta)
        return
    descriptors = {"x_desc": x_desc, "w_desc": w_desc, "out_desc": out_desc}
    kernel = (_swiglu_tma_fp8_out_kernel if quant is not None else _swiglu_tma_fp8_kernel) if fp8 else \
        _swiglu_tma_kernel
    launch_tuned(kernel, (width, x.shape[1], x.dtype, bias is not None, programs), grid, args, meta,
                 lambda config: _set_block_shapes({**descriptors, **config.kwargs}), tokens)


def takes_tma(x: Tensor, weight: Tensor, any_device: bool = False) -> bool:
    """Whether the tensor-descriptor kernel applies: a GPU with the copy engine (``has_copy_engine``) and 16-bit
    inputs (its tiles, three stages of [128, 64] x and [2, 128, 64] weight tiles, fill shared memory at two bytes an
    element) or float8 ones (tiles twice as deep), or the interpreter (or ``any_device``); and rows of x, the
    weight and the output that are multiples of 16 bytes."""
    if triton is None or TensorDescriptor is None:
        return False
    multiple = 16 // x.element_size()  # the copy engine's row strides are multiples of 16 bytes
    width = weight.shape[0] // 2
    aligned = x.shape[1] % multiple == 0 and width % multiple == 0
    if any_device or _INTERPRET:
        return aligned
    return aligned and (x.element_size() == 2 or x.dtype == FP8_DTYPE) and has_copy_engine(x.device)


def has_copy_engine(device: torch.device) -> bool:
    """Whether ``device`` is a GPU that loads tiles through tensor descriptors (Hopper on) with this triton."""
    return (triton is not None and TensorDescriptor is not None and device.type == "cuda"
            and cuda_capability(device)[0] >= 9)


if triton is not None:
    from rerankit.kernels.fp8_quant import bounded_codes, bounded_scale

    _MIN_AMAX = tl.constexpr(MIN_AMAX)

    @triton.jit
    def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Output tile number ``pid`` as (pid_m, pid_n); tiles are numbered in groups of GROUP_M row blocks, so
        neighbouring programs share weight tiles in the L2 cache (the q/k/v GEMM's tiles too)."""
        blocks_m = tl.cdiv(M, BLOCK_M)
        blocks_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * blocks_n
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(blocks_m - first_m, GROUP_M)
        return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m

    @triton.jit
    def _activate(gate, up, b_ptr, cols, col_ok, out_type: tl.constexpr, HAS_BIAS: tl.constexpr, N):
        """Bias, each projection rounded to ``out_type`` as F.linear rounds it, then silu(gate) * up in float32."""
        if HAS_BIAS:
            gate += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        gate = gate.to(out_type).to(tl.float32)
        up = up.to(out_type).to(tl.float32)
        return gate / (1.0 + tl.exp(-gate)) * up  # float32: the caller rounds (or quantizes) it

    def _swiglu_matmul_body(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """One [BLOCK_M, BLOCK_N] tile of the output, tiles loaded through pointers (any shape)."""
        pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
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
        activated = _activate(gate, up, b_ptr, cols, col_ok, out_ptr.dtype.element_ty, HAS_BIAS, N)
        activated = activated.to(out_ptr.dtype.element_ty)
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out_ptrs, activated, mask=row_ok[:, None] & col_ok[None, :])

    def _swiglu_tma_body(x_desc, w_desc, b_ptr, xs_ptr, ws_ptr, out_desc, lengths_ptr, out_scale_ptr, bound, M, N,
                         K, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, QUANT_OUT: tl.constexpr,
                         ROUND_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
        """Persistent: NUM_SMS programs walk the output tiles, each loop flattened so that the next tile's loads
        overlap this tile's activation and store. ``w_desc`` views the weight as [2, N, K] (gate rows, up rows):
        one copy-engine load brings the gate and the up tile of the same columns, and one [BLOCK_M, 2 * BLOCK_N]
        dot computes both (one wide tensor-core instruction per step, not two narrow ones). The accumulator's
        halves are the gate and the up projection. ``SCALED`` (float8 tiles): the accumulator times each row's
        ``xs`` and each column's ``ws`` first. ``QUANT_OUT`` (float8 output): row t's products are quantized under
        the bound ``bound * lengths[t]`` (``swiglu_matmul_fp8_out``), and the programs of the first column block
        store the rows' scales. Past the edges the copy engine reads zeros and the store drops what lies
        outside."""
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        steps = tl.cdiv(K, BLOCK_K)
        stored = tl.program_id(0) - NUM_SMS  # the epilogue's tile, counted apart from the loads' (as Triton's
        for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=True):  # persistent matmul tutorial does)
            pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            both = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
            for step in range(steps):
                w = w_desc.load([0, pid_n * BLOCK_N, step * BLOCK_K]).reshape(2 * BLOCK_N, BLOCK_K)
                both = tl.dot(x_desc.load([pid_m * BLOCK_M, step * BLOCK_K]), w.T, both)
            stored += NUM_SMS
            pid_m, pid_n = grouped_tile(stored, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            gate, up = tl.split(tl.permute(tl.reshape(both, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            if SCALED:
                row_scale = tl.load(xs_ptr + rows, mask=rows < M, other=0.0)[:, None]
                gate = gate * row_scale * tl.load(ws_ptr + cols, mask=cols < N, other=0.0)[None, :]
                up = up * row_scale * tl.load(ws_ptr + N + cols, mask=cols < N, other=0.0)[None, :]
            if QUANT_OUT:
                activated = _activate(gate, up, b_ptr, cols, cols < N, tl.bfloat16, HAS_BIAS, N)
                row_bound = tl.maximum(tl.load(lengths_ptr + rows, mask=rows < M, other=0.0) * bound, _MIN_AMAX)
                activated = bounded_codes(activated, row_bound[:, None], ROUND_FIRST)
                if pid_n == 0:
                    tl.store(out_scale_ptr + rows, bounded_scale(row_bound), mask=rows < M)
            else:
                activated = _activate(gate, up, b_ptr, cols, cols < N, out_desc.dtype, HAS_BIAS, N)
            out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], activated.to(out_desc.dtype))

    def _set_block_shapes(nargs: dict) -> None:
        """Each tuning config's tile shapes into the descriptors (they are built before a config is chosen)."""
        block_m, block_n, block_k = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
        nargs["x_desc"].block_shape = [block_m, block_k]
        nargs["w_desc"].block_shape = [2, block_n, block_k]
        nargs["out_desc"].block_shape = [block_m, block_n]

    # The pointer kernel keeps two accumulators per program: 128 x 64 fp32 tiles with 8 warps hold 64 registers a
    # thread each. Autotuned once per (N, K) and bucket of token counts (``token_bucket``), on the bucket's first batch
    # (a CUDA-graph capture warms up eagerly first, so tuning never runs inside a capture).
    _CONFIGS = [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    ]
    # The descriptor kernel's accumulator is [BLOCK_M, 2 * BLOCK_N] (gate and up side by side). H100, Qwen3-0.6B
    # MLP, 5k-27k tokens: 128 x 256 with 8 warps and 3 stages ran at 575-619 TFLOP/s, against 527-541 for two
    # 128 x 64 accumulators fed by separate loads, and 486-509 for the same wide tile launched once per tile. When
    # the tuner ran once per (N, K), at the first call's batch size, 4 stages tied 3 at 26.6k tokens (0.546 ms) and
    # then served LI's 14.6k at 0.294 ms against 0.279 for 3 stages, so it is not offered; 32-wide K steps in 5-7
    # stages ran 0.311-0.312 there.
    _TMA_CONFIGS = [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3,
                      pre_hook=_set_block_shapes),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4,
                      pre_hook=_set_block_shapes),
    ]
    # FP8 tiles: one byte an element, so 128-deep K steps take the shared memory that 64-deep 16-bit ones took (three
    # stages of [128, 128] x and [2, 128, 128] weight tiles: 144 KB). The tuner picks among them per bucket of token
    # counts (benchmarks/fp8_matmul.py, benchmarks/swiglu_fp8_out.py time each).
    _TMA_FP8_CONFIGS = [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=8, num_stages=3,
                      pre_hook=_set_block_shapes),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4,
                      pre_hook=_set_block_shapes),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=4, num_stages=4,
                      pre_hook=_set_block_shapes),
    ]
    _swiglu_matmul_kernel = triton.autotune(_CONFIGS, key=["M", "N", "K"])(triton.jit(_swiglu_matmul_body))
    _swiglu_tma_kernel = triton.autotune(_TMA_CONFIGS, key=["M", "N", "K"])(triton.jit(_swiglu_tma_body))
    _swiglu_tma_fp8_kernel = triton.autotune(_TMA_FP8_CONFIGS, key=["M", "N", "K"])(triton.jit(_swiglu_tma_body))
    # float8 output: the epilogue's tile takes half the shared memory of a bf16 one, which leaves room for a fourth
    # stage of 128-deep tiles (4 x 48 KB + 16 KB). H100, benchmarks/swiglu_fp8_out.py: 4 stages 0.720 ms against
    # 0.729 for 3 on the 4B MLP at 8k tokens; 3 ahead at 4k (0.343 against 0.350) and on 8B (0.671 against 0.684).
    _TMA_FP8_OUT_CONFIGS = [*_TMA_FP8_CONFIGS, triton.Config(
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=8, num_stages=4,
        pre_hook=_set_block_shapes)]
    _swiglu_tma_fp8_out_kernel = triton.autotune(_TMA_FP8_OUT_CONFIGS, key=["M", "N", "K"])(
        triton.jit(_swiglu_tma_body))
    # The interpreter runs one small tile: tuning there would only multiply the test time.
    _INTERPRETED = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}
    _swiglu_matmul_kernel_interpreted = triton.autotune(
        [triton.Config(_INTERPRETED)], key=["N", "K"])(triton.jit(_swiglu_matmul_body))
    _swiglu_tma_kernel_interpreted = triton.autotune(
        [triton.Config(_INTERPRETED, pre_hook=_set_block_shapes)], key=["N", "K"])(triton.jit(_swiglu_tma_body))
