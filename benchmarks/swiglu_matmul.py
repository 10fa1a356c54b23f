"""The SwiGLU gate/up GEMM: rerankit's Triton kernel (activation in the epilogue) vs cuBLAS + torch.compile, GPU.

For the MLP shapes of the Qwen3-Reranker sizes and token counts of W3 / LI / W1 micro-batches: median time (triton
do_bench) of ``swiglu_matmul`` against ``F.linear`` followed by a compiled ``silu(gate) * up`` (what the decoder
runs today), their ratio, our TFLOP/s, and the largest difference between the two outputs. This decides
``PackedDecoder.fused_swiglu``; ``benchmarks/pairs.py --ab`` then times whole calls with it.

    PYTHONPATH=src python benchmarks/swiglu_matmul.py [--out bench_out/swiglu_matmul.jsonl]
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from rerankit.kernels.swiglu_matmul import swiglu_matmul, takes_tma

SHAPES = {"0.6b": (1024, 3072), "4b": (2560, 9728), "8b": (4096, 12288)}  # hidden d, intermediate I
TOKENS = (5120, 13824, 26624)  # ~W3, ~LI, ~W1 micro-batches


@torch.compile(dynamic=True)
def activation(projected: torch.Tensor) -> torch.Tensor:
    gate, up = projected.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_path(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return activation(F.linear(x, weight))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    for shape, (hidden, width) in SHAPES.items():
        weight = (torch.randn(2 * width, hidden, device="cuda") / hidden ** 0.5).bfloat16()
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, device="cuda").bfloat16()
            theirs = torch_path(x, weight)  # tunes and compiles outside the timing
            flop = 2 * tokens * hidden * 2 * width
            row = {"shape": shape, "tokens": tokens}
            for name, tma in (("pointers", False), ("descriptors", True)):
                ours = swiglu_matmul(x, weight, tma=tma)
                row[f"{name}_ms"] = do_bench(lambda: swiglu_matmul(x, weight, tma=tma), return_mode="median")
                row[f"{name}_tflops"] = flop / row[f"{name}_ms"] / 1e9
                row[f"{name}_max_abs_diff"] = float((ours.float() - theirs.float()).abs().max())
            ours_ms = min(row["pointers_ms"], row["descriptors_ms"])
            torch_ms = do_bench(lambda: torch_path(x, weight), return_mode="median")
            gemm_ms = do_bench(lambda: F.linear(x, weight), return_mode="median")
            row.update({"auto_tma": takes_tma(x, weight), "ours_ms": ours_ms, "cublas_inductor_ms": torch_ms,
                        "cublas_gemm_ms": gemm_ms, "cublas_gemm_tflops": flop / gemm_ms / 1e9,
                        "speedup": torch_ms / ours_ms, "ours_tflops": flop / ours_ms / 1e9,
                        "max_abs_diff": max(row["pointers_max_abs_diff"], row["descriptors_max_abs_diff"])})
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'shape':<6}{'tokens':>8}{'ptr ms':>9}{'tma ms':>9}{'torch ms':>10}{'gemm ms':>9}{'speed-up':>10}"
          f"{'ptr TF/s':>9}{'tma TF/s':>9}{'gemm TF/s':>10}{'max diff':>10}")
    for row in rows:
        print(f"{row['shape']:<6}{row['tokens']:>8}{row['pointers_ms']:>9.3f}{row['descriptors_ms']:>9.3f}"
              f"{row['cublas_inductor_ms']:>10.3f}{row['cublas_gemm_ms']:>9.3f}{row['speedup']:>9.2f}x"
              f"{row['pointers_tflops']:>9.0f}{row['descriptors_tflops']:>9.0f}{row['cublas_gemm_tflops']:>10.0f}"
              f"{row['max_abs_diff']:>10.4f}")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
