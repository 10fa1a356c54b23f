"""The FP8 SwiGLU GEMM with float8 output (``swiglu_matmul_fp8_out``) at the 4B and 8B MLP shapes: the autotuned
kernel, the path it replaces (bf16 output, then a quantization pass), and each descriptor-kernel tile config alone.
A config's codes are checked against the autotuned kernel's (the share of equal codes). On a GPU with Hopper's copy
engine:

    PYTHONPATH=src python benchmarks/swiglu_fp8_out.py

Times are medians of ``triton.testing.do_bench`` (300 ms of calls after 50 ms of warm-up); TFLOP/s count the
2 * T * d * 2I of the projection.
"""

from __future__ import annotations

import torch
import triton
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

from rerankit.kernels import sm_count
from rerankit.kernels import swiglu_matmul as swiglu
from rerankit.kernels.fp8_quant import FP8_DTYPE, quantize_rows, quantize_rows_reference, rms_norm_quant

SHAPES = ((2560, 9728, 4096), (2560, 9728, 8192), (4096, 12288, 4096))  # (d, I, tokens): 4B, 4B, 8B
CONFIGS = [  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages
    (128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 64, 8, 4), (128, 64, 128, 4, 4), (128, 64, 128, 4, 3),
]


def bench(fn) -> float:
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def inputs(hidden: int, width: int, tokens: int):
    """A normed activation's float8 codes, scales and squared lengths, and a float8 gate/up weight [2I, d] with its
    scales, from seed 0."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    norm = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).bfloat16()
    codes, scale, lengths = rms_norm_quant(x, norm, 1e-6, sumsq=True)
    weight, w_scale = quantize_rows_reference(
        (torch.randn(2 * width, hidden, device="cuda", generator=gen) / hidden ** 0.5).bfloat16())
    return codes, scale, lengths, weight, w_scale


def main() -> None:
    kernel = triton.jit(swiglu._swiglu_tma_body)
    programs = sm_count(torch.device("cuda"), 4)
    for hidden, width, tokens in SHAPES:
        codes, scale, lengths, weight, w_scale = inputs(hidden, width, tokens)
        bound = swiglu.swiglu_bound(weight, w_scale)
        flops = 2 * tokens * hidden * 2 * width
        tuned = bench(lambda: swiglu.swiglu_matmul_fp8_out(codes, weight, scale, w_scale, lengths, bound))
        before = bench(lambda: quantize_rows(swiglu.swiglu_matmul(codes, weight, x_scale=scale, w_scale=w_scale)))
        expected, _ = swiglu.swiglu_matmul_fp8_out(codes, weight, scale, w_scale, lengths, bound)
        print(f"d={hidden} I={width} T={tokens}: float8 out (autotuned) {tuned:.4f} ms "
              f"({flops / tuned / 1e9:.0f} TFLOP/s); bf16 out + quantization pass {before:.4f} ms", flush=True)
        for block_m, block_n, block_k, warps, stages in CONFIGS:
            out = torch.empty(tokens, width, dtype=FP8_DTYPE, device="cuda")
            out_scale = torch.empty(tokens, dtype=torch.float32, device="cuda")
            descriptors = (TensorDescriptor.from_tensor(codes, [block_m, block_k]),
                           TensorDescriptor.from_tensor(weight.view(2, width, hidden), [2, block_n, block_k]))
            out_desc = TensorDescriptor.from_tensor(out, [block_m, block_n])
            grid = (min(programs, triton.cdiv(tokens, block_m) * triton.cdiv(width, block_n)),)

            def run():
                kernel[grid](*descriptors, out, scale, w_scale, out_desc, lengths, out_scale, bound, tokens, width,
                             hidden, HAS_BIAS=False, SCALED=True, QUANT_OUT=True, ROUND_FIRST=False,
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, NUM_SMS=programs,
                             num_warps=warps, num_stages=stages)

            run()
            same = (out.float() == expected.float()).float().mean().item()
            took = bench(run)
            print(f"  {block_m}x{block_n}x{block_k}, {warps} warps, {stages} stages: {took:.4f} ms "
                  f"({flops / took / 1e9:.0f} TFLOP/s), codes equal to the autotuned kernel's: {same:.4f}", flush=True)


if __name__ == "__main__":
    main()
