"""The FP8 SwiGLU GEMM, warp-specialized ping-pong (Gluon, ``kernels/swiglu_ws.py``) against the Triton kernel it stands in for,
at the MLP shapes of Qwen3-0.6B, 4B and 8B and the token counts of W1's micro-batches and the 32-document calls,
with bf16 output (``swiglu_matmul``) and float8 output (``swiglu_matmul_fp8_out``). Each Gluon row is checked bit
for bit against the Triton kernel's output. On an sm_90 GPU:

    PYTHONPATH=src python benchmarks/swiglu_ws.py

Times are medians of ``triton.testing.do_bench`` (300 ms of calls after 50 ms of warm-up), the two kernels timed
in turn at each shape; TFLOP/s count the 2 * T * d * 2I of the projection.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from rerankit.kernels import swiglu_matmul as swiglu
from rerankit.kernels import swiglu_ws
from rerankit.kernels.fp8_quant import FP8_DTYPE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from swiglu_fp8_out import bench, inputs  # noqa: E402  (the same inputs and timing)

SHAPES = {  # (d, I, token counts)
    "0.6b": (1024, 3072, (4352, 22912, 26624)),
    "4b": (2560, 9728, (4096, 8192)),
    "8b": (4096, 12288, (4096, 8192)),
}


def triton_kernel(run):
    """``run()`` with the Triton kernel (the warp-specialized one switched off)."""
    os.environ[swiglu.KERNEL_ENV] = "triton"
    try:
        return run()
    finally:
        del os.environ[swiglu.KERNEL_ENV]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.6b,4b,8b", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--stages", type=lambda text: [int(part) for part in text.split(",")], default=[4, 5, 6],
                        help="the Gluon kernel's shared-memory slots to time, comma-separated")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}; ms (TFLOP/s); Gluon rows: bits equal to the Triton kernel's")
    for name in args.shapes.split(","):
        hidden, width, counts = SHAPES[name]
        for tokens in counts:
            codes, scale, lengths, weight, w_scale = inputs(hidden, width, tokens)
            bound = swiglu.swiglu_bound(weight, w_scale)
            flops = 2 * tokens * hidden * 2 * width
            cases = {
                "bf16 out": (lambda: swiglu.swiglu_matmul(codes, weight, x_scale=scale, w_scale=w_scale), None),
                "fp8 out": (lambda: swiglu.swiglu_matmul_fp8_out(codes, weight, scale, w_scale, lengths, bound),
                            (lengths, bound)),
            }
            for label, (run, quant) in cases.items():
                expected = triton_kernel(run)
                triton_ms = triton_kernel(lambda: bench(run))  # noqa: B023
                row = [f"{name} T={tokens} {label}: Triton {triton_ms:.4f} ({flops / triton_ms / 1e9:.0f})"]
                for stages in args.stages:
                    def gluon(stages=stages, quant=quant):
                        return swiglu_ws.swiglu_ws(codes, weight, scale, w_scale, quant, stages=stages)
                    try:
                        got = gluon()
                    except Exception as error:  # a stage count over the shared memory is a result too
                        row.append(f"Gluon {stages} stages: {type(error).__name__} {str(error)[:80]}")
                        continue
                    same = all(torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                                           b.view(torch.uint8) if b.dtype == FP8_DTYPE else b)
                               for a, b in zip(*((g,) if quant is None else g for g in (got, expected))))
                    took = bench(gluon)
                    row.append(f"Gluon {stages} stages {took:.4f} ({flops / took / 1e9:.0f}, "
                               f"x{triton_ms / took:.3f}, equal={same})")
                print("; ".join(row), flush=True)


if __name__ == "__main__":
    main()
