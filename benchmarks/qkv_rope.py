"""The q/k/v projection with q/k norm and rotary: rerankit's fused Triton GEMM vs cuBLAS + the q/k kernel, GPU.

For the attention shapes of the Qwen3-Reranker sizes (hidden d; q, kv heads of 128) and token counts of W3 / LI / W1
micro-batches: median time (triton do_bench) of ``qkv_rope_matmul`` (norm and rotary in the GEMM's epilogue, the
angles from a cos/sin table built once a forward, not timed here: it serves every layer) against ``F.linear``
followed by ``qk_norm_rope`` (the decoder's path before it), cuBLAS's GEMM alone, the ratio, our TFLOP/s, and the
largest difference between the two outputs. This decides ``PackedDecoder.fused_qkv_rope``; ``benchmarks/timeline.py
--ab`` then times whole calls with it.

    PYTHONPATH=src python benchmarks/qkv_rope.py [--out bench_out/qkv_rope.jsonl]
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from rerankit.kernels.qk_norm_rope import qk_norm_rope
from rerankit.kernels import qkv_rope_matmul as kernels
from rerankit.kernels.qkv_rope_matmul import qkv_rope_matmul, rope_table

SHAPES = {"0.6b": (1024, 16, 8), "4b": (2560, 32, 8), "8b": (4096, 32, 8)}  # hidden d, q heads, kv heads
HEAD_DIM = 128
TOKENS = (5120, 14629, 26624)  # ~W3, LI (head kept), ~W1 micro-batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM)
    for shape, (hidden, heads, kv_heads) in SHAPES.items():
        width = (heads + 2 * kv_heads) * HEAD_DIM
        weight = (torch.randn(width, hidden, device="cuda") / hidden ** 0.5).bfloat16()
        q_norm, k_norm = (torch.rand(HEAD_DIM, device="cuda") + 0.5).bfloat16(), (torch.rand(HEAD_DIM, device="cuda")
                                                                                   + 0.5).bfloat16()
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, device="cuda").bfloat16()
            positions = torch.randint(0, 2048, (tokens,), device="cuda")
            cos, sin = rope_table(positions, inv_freq)

            def ours():
                return qkv_rope_matmul(x, weight, None, heads, kv_heads, HEAD_DIM, cos, sin, q_norm, k_norm)

            def theirs():
                qkv = F.linear(x, weight)
                q, k = qk_norm_rope(qkv, heads, kv_heads, HEAD_DIM, positions, inv_freq, q_norm, k_norm)
                return torch.cat([q.flatten(1), k.flatten(1), qkv[:, (heads + kv_heads) * HEAD_DIM:]], 1)

            difference = float((ours().float() - theirs().float()).abs().max())  # tunes outside the timing
            flop = 2 * tokens * hidden * width
            ours_ms = do_bench(ours, return_mode="median")
            # theirs() without the cat, which only lays the outputs side by side for the comparison above
            torch_ms = do_bench(lambda: qk_norm_rope(F.linear(x, weight), heads, kv_heads, HEAD_DIM, positions,
                                                     inv_freq, q_norm, k_norm), return_mode="median")
            gemm_ms = do_bench(lambda: F.linear(x, weight), return_mode="median")
            row = {"shape": shape, "tokens": tokens, "ours_ms": ours_ms, "cublas_qk_kernel_ms": torch_ms,
                   "cublas_gemm_ms": gemm_ms, "speedup": torch_ms / ours_ms, "ours_tflops": flop / ours_ms / 1e9,
                   "cublas_gemm_tflops": flop / gemm_ms / 1e9, "max_abs_diff": difference,
                   "tile": str(kernels._qkv_rope_kernel.best_config)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'shape':<6}{'tokens':>8}{'ours ms':>9}{'torch ms':>10}{'gemm ms':>9}{'speed-up':>10}{'ours TF/s':>10}"
          f"{'gemm TF/s':>10}{'max diff':>10}")
    for row in rows:
        print(f"{row['shape']:<6}{row['tokens']:>8}{row['ours_ms']:>9.3f}{row['cublas_qk_kernel_ms']:>10.3f}"
              f"{row['cublas_gemm_ms']:>9.3f}{row['speedup']:>9.2f}x{row['ours_tflops']:>10.0f}"
              f"{row['cublas_gemm_tflops']:>10.0f}{row['max_abs_diff']:>10.4f}")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
