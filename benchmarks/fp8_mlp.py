"""The FP8 MLP with the next layer's norm, as the decoder runs it, with down in bf16 and in FP8:

    bf16 down: h = swiglu_matmul(x) (bf16 out); hidden += h @ Wd.T (cuBLAS, in its epilogue); rms_norm_quant(hidden)
    FP8 down:  h = swiglu_matmul_fp8_out(x); d = fp8_matmul(h, Wd) (cuBLAS); add_rms_norm_quant(hidden, d)

where x is the FP8 activation from the norm before. Times each step and the whole, at the 0.6B, 4B and 8B MLP shapes
(the token counts of W1's and the 4B row's micro-batches). On a GPU with Hopper's copy engine:

    PYTHONPATH=src python benchmarks/fp8_mlp.py

Medians of ``triton.testing.do_bench`` (300 ms of calls after 50 ms of warm-up), in ms.
"""

from __future__ import annotations

import torch
from triton.testing import do_bench

from rerankit.kernels import swiglu_matmul as swiglu
from rerankit.kernels.fp8_matmul import fp8_matmul
from rerankit.kernels.fp8_quant import add_rms_norm_quant, quantize_rows_reference, rms_norm_quant

SHAPES = ((1024, 3072, 26624), (1024, 3072, 4352), (2560, 9728, 4096), (2560, 9728, 8192), (4096, 12288, 4096))


def bench(fn) -> float:
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def main() -> None:
    for hidden_size, width, tokens in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(tokens, hidden_size, device="cuda", generator=gen).bfloat16()
        norm = (torch.rand(hidden_size, device="cuda", generator=gen) + 0.5).bfloat16()
        codes, scale, lengths = rms_norm_quant(hidden, norm, 1e-6, sumsq=True)
        gate_up = (torch.randn(2 * width, hidden_size, device="cuda", generator=gen) / hidden_size ** 0.5).bfloat16()
        down = (torch.randn(hidden_size, width, device="cuda", generator=gen) / width ** 0.5).bfloat16()
        gu_codes, gu_scale = quantize_rows_reference(gate_up)
        d_codes, d_scale = quantize_rows_reference(down)
        bound = swiglu.swiglu_bound(gu_codes, gu_scale)
        h16 = swiglu.swiglu_matmul(codes, gu_codes, x_scale=scale, w_scale=gu_scale)
        h8, h8_scale = swiglu.swiglu_matmul_fp8_out(codes, gu_codes, scale, gu_scale, lengths, bound)
        delta = fp8_matmul(h8, h8_scale, d_codes, d_scale)
        work = hidden.clone()
        steps = {
            "swiglu bf16 out": lambda: swiglu.swiglu_matmul(codes, gu_codes, x_scale=scale, w_scale=gu_scale),
            "swiglu float8 out": lambda: swiglu.swiglu_matmul_fp8_out(codes, gu_codes, scale, gu_scale, lengths,
                                                                      bound),
            "down bf16 (addmm into hidden)": lambda: work.addmm_(h16, down.t()),
            "down FP8 (_scaled_mm)": lambda: fp8_matmul(h8, h8_scale, d_codes, d_scale),
            "norm + quant": lambda: rms_norm_quant(work, norm, 1e-6, sumsq=True),
            "add + norm + quant": lambda: add_rms_norm_quant(work, delta, norm, 1e-6, sumsq=True),
        }
        times = {name: bench(fn) for name, fn in steps.items()}

        def bf16_down():
            h = swiglu.swiglu_matmul(codes, gu_codes, x_scale=scale, w_scale=gu_scale)
            work.addmm_(h, down.t())
            rms_norm_quant(work, norm, 1e-6, sumsq=True)

        def fp8_down():
            h, h_scale = swiglu.swiglu_matmul_fp8_out(codes, gu_codes, scale, gu_scale, lengths, bound)
            add_rms_norm_quant(work, fp8_matmul(h, h_scale, d_codes, d_scale), norm, 1e-6, sumsq=True)

        whole = {"whole, bf16 down": bench(bf16_down), "whole, FP8 down": bench(fp8_down)}
        print(f"d={hidden_size} I={width} T={tokens}: " + "; ".join(f"{k} {v:.4f}" for k, v in
                                                                   {**times, **whole}.items()), flush=True)
        work.copy_(hidden)


if __name__ == "__main__":
    main()
