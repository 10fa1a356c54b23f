"""FP8 projection of an input scaled per 1 x 128 block, with per-output-channel weight scales, output bf16:

    out[t, n] = sum_b (sum_{k in block b} x[t, k] * w[n, k]) * x_scale[b, t] * w_scale[n] (+ bias[n])

accumulated in float32. The down projection's input is the SwiGLU GEMM's output, and a tile of that GEMM sees 128 of
a token's columns, not the whole row: it quantizes what it sees (``swiglu_matmul_quant``), one scale per token per
128 columns, so no pass reads the activation back to find each token's amax over every column. This GEMM takes
those scales in its main loop: each 128-deep K step's product is scaled by its rows' scales as it is added to the
accumulator, the weight's scales in the epilogue.

One Triton kernel: persistent, tiles through tensor descriptors (Hopper's copy engine, or the interpreter); where it
does not apply, the plain-torch reference (float32 dequantized product).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from rerankit.kernels import launch_tuned, sm_count
from rerankit.kernels.fp8_quant import FP8_DTYPE, QUANT_BLOCK, dequantize_blocks

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
_ROW_BYTES = 16  # the copy engine's row strides are multiples of 16 bytes


def _check(x: Tensor, x_scale: Tensor, weight: Tensor, w_scale: Tensor, bias: Tensor | None) -> None:
    if x.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
        raise ValueError(f"x and weight must be {FP8_DTYPE}, got {x.dtype} and {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [T, d] and weight [N, d], got {tuple(x.shape)} and {tuple(weight.shape)}")
    blocks = -(-x.shape[1] // QUANT_BLOCK)
    if x_scale.shape != (blocks, x.shape[0]) or w_scale.shape != (weight.shape[0],):
        raise ValueError(f"x_scale must be [{blocks}, {x.shape[0]}] (one per {QUANT_BLOCK} columns of a token, "
                         f"block-major) and w_scale [{weight.shape[0]}], got {tuple(x_scale.shape)} and "
                         f"{tuple(w_scale.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def fp8_block_matmul_reference(x: Tensor, x_scale: Tensor, weight: Tensor, w_scale: Tensor,
                               bias: Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Plain torch: ``x`` dequantized per block in float32, times the dequantized weight, the bias in float32,
    rounded once to ``out_dtype``."""
    _check(x, x_scale, weight, w_scale, bias)
    out = (dequantize_blocks(x, x_scale) @ weight.float().T) * w_scale[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def takes_tma(weight: Tensor) -> bool:
    """Whether the kernel applies to float8 ``weight`` [N, d]: triton with tensor descriptors, a GPU with Hopper's
    copy engine (or the interpreter), and rows of x, the weight and the bf16 output in multiples of 16 bytes."""
    if triton is None or TensorDescriptor is None or weight.shape[1] % _ROW_BYTES or weight.shape[0] % 8:
        return False
    if _INTERPRET:
        return True
    from rerankit.kernels.swiglu_matmul import has_copy_engine

    return has_copy_engine(weight.device)


def fp8_block_matmul(x: Tensor, x_scale: Tensor, weight: Tensor, w_scale: Tensor, bias: Tensor | None = None,
                     out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``x @ weight.T`` of float8_e4m3fn ``x`` [T, d] with block-major scales ``x_scale`` [ceil(d / 128), T]
    (``quantize_blocks_reference``'s layout) and ``weight`` [N, d] with per-row scales ``w_scale`` [N]:
    ``out_dtype`` [T, N]."""
    if not (x.is_cuda or _INTERPRET) or not takes_tma(weight):
        return fp8_block_matmul_reference(x, x_scale, weight, w_scale, bias, out_dtype)
    _check(x, x_scale, weight, w_scale, bias)
    x, weight = x.contiguous(), weight.contiguous()
    tokens, width = x.shape[0], weight.shape[0]
    out = torch.empty(tokens, width, dtype=out_dtype, device=x.device)
    if tokens == 0:
        return out
    x_desc, w_desc, out_desc = (TensorDescriptor.from_tensor(t, [16, 16]) for t in (x, weight, out))
    programs = sm_count(x.device, interpreted=4)
    grid = lambda meta: (min(programs, triton.cdiv(tokens, meta["BLOCK_M"])  # noqa: E731
                             * triton.cdiv(width, meta["BLOCK_N"])),)
    args = (x_desc, w_desc, x_scale.float().contiguous(), w_scale.float().contiguous(),
            bias if bias is not None else out, out_desc, tokens, width, x.shape[1])
    meta = dict(HAS_BIAS=bias is not None, NUM_SMS=programs)
    if _INTERPRET:
        _block_matmul_kernel_interpreted[grid](*args, **meta)
    else:
        descriptors = {"x_desc": x_desc, "w_desc": w_desc, "out_desc": out_desc}
        launch_tuned(_block_matmul_kernel, (width, x.shape[1], out_dtype, bias is not None, programs), grid, args,
                     meta, lambda config: _set_block_shapes({**descriptors, **config.kwargs}), tokens)
    return out


if triton is not None:
    from rerankit.kernels.swiglu_matmul import grouped_tile

    _QUANT_BLOCK = tl.constexpr(QUANT_BLOCK)

    def _block_matmul_body(x_desc, w_desc, xs_ptr, ws_ptr, b_ptr, out_desc, M, N, K, HAS_BIAS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
        """Persistent: NUM_SMS programs walk the output tiles (the loop flattened, so the next tile's loads overlap
        this tile's epilogue, as in the SwiGLU kernel). Each K step's product starts from zero and is added to the
        accumulator times its rows' scales (BLOCK_K divides 128: steps of one block share its scales)."""
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        steps = tl.cdiv(K, BLOCK_K)
        stored = tl.program_id(0) - NUM_SMS
        for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=True):
            pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for step in range(steps):
                part = tl.dot(x_desc.load([pid_m * BLOCK_M, step * BLOCK_K]),
                              w_desc.load([pid_n * BLOCK_N, step * BLOCK_K]).T)
                scale = tl.load(xs_ptr + (step * BLOCK_K // _QUANT_BLOCK) * M + rows, mask=rows < M, other=0.0)
                acc += part * scale[:, None]
            stored += NUM_SMS
            pid_m, pid_n = grouped_tile(stored, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = acc * tl.load(ws_ptr + cols, mask=cols < N, other=0.0)[None, :]
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(out_desc.dtype))

    def _set_block_shapes(nargs: dict) -> None:
        """Each tuning config's tile shapes into the descriptors (they are built before a config is chosen)."""
        block_m, block_n, block_k = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
        nargs["x_desc"].block_shape = [block_m, block_k]
        nargs["w_desc"].block_shape = [block_n, block_k]
        nargs["out_desc"].block_shape = [block_m, block_n]

    # One byte an element: 128-deep steps in three or four stages of [128, 128] x and weight tiles (96-128 KB).
    _CONFIGS = [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=8, num_stages=3,
                      pre_hook=_set_block_shapes),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=8, num_stages=4,
                      pre_hook=_set_block_shapes),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4,
                      pre_hook=_set_block_shapes),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=4, num_stages=4,
                      pre_hook=_set_block_shapes),
    ]
    _block_matmul_kernel = triton.autotune(_CONFIGS, key=["M", "N", "K"])(triton.jit(_block_matmul_body))
    # The interpreter runs one small tile (K steps of 64: two share a block's scales).
    _block_matmul_kernel_interpreted = triton.autotune(
        [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 2}, pre_hook=_set_block_shapes)],
        key=["N", "K"])(triton.jit(_block_matmul_body))
