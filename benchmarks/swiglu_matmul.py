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

from rerankit.kernels.swiglu_matmul import swiglu_matmul

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
            ours, theirs = swiglu_matmul(x, weight), torch_path(x, weight)  # tunes and compiles outside the timing
            ours_ms = do_bench(lambda: swiglu_matmul(x, weight), return_mode="median")
            torch_ms = do_bench(lambda: torch_path(x, weight), return_mode="median")
            row = {"shape": shape, "tokens": tokens, "ours_ms": ours_ms, "cublas_inductor_ms": torch_ms,
                   "speedup": torch_ms / ours_ms, "ours_tflops": 2 * tokens * hidden * 2 * width / ours_ms / 1e9,
                   "max_abs_diff": float((ours.float() - theirs.float()).abs().max())}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'shape':<6}{'tokens':>8}{'ours ms':>10}{'torch ms':>10}{'speed-up':>10}{'TFLOP/s':>9}{'max diff':>10}")
    for row in rows:
        print(f"{row['shape']:<6}{row['tokens']:>8}{row['ours_ms']:>10.3f}{row['cublas_inductor_ms']:>10.3f}"
              f"{row['speedup']:>9.2f}x{row['ours_tflops']:>9.0f}{row['max_abs_diff']:>10.4f}")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
