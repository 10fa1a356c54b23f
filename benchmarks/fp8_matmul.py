"""FP8 GEMMs on the GPU: rerankit's FP8 SwiGLU and q/k/v kernels vs their bf16 versions vs cuBLAS's FP8 GEMM.

For the Qwen3-Reranker shapes and token counts of W3 / LI / W1 micro-batches, median times (triton do_bench) of:
  gate/up + SwiGLU   swiglu_matmul FP8 | swiglu_matmul bf16 | cuBLAS _scaled_mm (rowwise) FP8 GEMM alone
  q/k/v + norm/rope  qkv_rope_matmul FP8 | qkv_rope_matmul bf16 | cuBLAS _scaled_mm FP8 GEMM alone
  o / down           cuBLAS _scaled_mm FP8 | cuBLAS bf16 F.linear
  quantization       rms_norm_quant (one launch) | quantize_rows
with TFLOP/s of each GEMM and the largest difference of each FP8 output from its float32-dequantizing reference.
This decides whether the decoder's FP8 layer keeps the fused kernels (``engine.models.fp8``).

    PYTHONPATH=src python benchmarks/fp8_matmul.py [--out bench_out/fp8_matmul.jsonl]
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from rerankit.kernels.fp8_matmul import fp8_matmul
from rerankit.kernels.fp8_quant import quantize_rows, quantize_rows_reference, rms_norm_quant
from rerankit.kernels.qkv_rope_matmul import qkv_rope_matmul, qkv_rope_matmul_reference, rope_table
from rerankit.kernels.swiglu_matmul import swiglu_matmul, swiglu_matmul_reference

SHAPES = {"0.6b": (1024, 3072, 16), "4b": (2560, 9728, 32), "8b": (4096, 12288, 32)}  # d, I, q heads (8 kv, D 128)
TOKENS = (5120, 13824, 26624)  # ~W3, ~LI, ~W1 micro-batches


def bench(fn) -> float:
    return do_bench(fn, return_mode="median")


def run_shape(shape: str, tokens: int) -> dict:
    hidden, width, heads = SHAPES[shape]
    kv_heads, head_dim = 8, 128
    qkv_width = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    norm = (torch.rand(hidden, device="cuda") + 0.5).bfloat16()
    gate_up = (torch.randn(2 * width, hidden, device="cuda") / hidden ** 0.5).bfloat16()
    qkv = (torch.randn(qkv_width, hidden, device="cuda") / hidden ** 0.5).bfloat16()
    down = (torch.randn(hidden, width, device="cuda") / width ** 0.5).bfloat16()
    codes, scale = rms_norm_quant(x, norm, 1e-6)
    gate_up8, gate_up_scale = quantize_rows_reference(gate_up)
    qkv8, qkv_scale = quantize_rows_reference(qkv)
    down8, down_scale = quantize_rows_reference(down)
    inner = torch.randn(tokens, width, device="cuda").bfloat16()
    inner8, inner_scale = quantize_rows(inner)
    positions = torch.arange(tokens, device="cuda") % 448
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim)
    cos, sin = rope_table(positions, inv_freq)
    q_norm = k_norm = (torch.rand(head_dim, device="cuda") + 0.5).bfloat16()
    rope_args = (heads, kv_heads, head_dim, cos, sin, q_norm, k_norm)
    row: dict = {"shape": shape, "tokens": tokens}
    gemms = {
        "swiglu_fp8": (lambda: swiglu_matmul(codes, gate_up8, x_scale=scale, w_scale=gate_up_scale), 2 * width),
        "swiglu_bf16": (lambda: swiglu_matmul(x, gate_up), 2 * width),
        "swiglu_scaled_mm": (lambda: fp8_matmul(codes, scale, gate_up8, gate_up_scale), 2 * width),
        "qkv_fp8": (lambda: qkv_rope_matmul(codes, qkv8, None, *rope_args, x_scale=scale, w_scale=qkv_scale),
                    qkv_width),
        "qkv_bf16": (lambda: qkv_rope_matmul(x, qkv, None, *rope_args), qkv_width),
        "qkv_scaled_mm": (lambda: fp8_matmul(codes, scale, qkv8, qkv_scale), qkv_width),
    }
    for name, (fn, columns) in gemms.items():
        fn()  # tunes outside the timing
        row[f"{name}_ms"] = bench(fn)
        row[f"{name}_tflops"] = 2 * tokens * hidden * columns / row[f"{name}_ms"] / 1e9
    down_flop = 2 * tokens * width * hidden
    row["down_scaled_mm_ms"] = bench(lambda: fp8_matmul(inner8, inner_scale, down8, down_scale))
    row["down_bf16_ms"] = bench(lambda: F.linear(inner, down))
    row["down_scaled_mm_tflops"] = down_flop / row["down_scaled_mm_ms"] / 1e9
    row["down_bf16_tflops"] = down_flop / row["down_bf16_ms"] / 1e9
    row["rms_norm_quant_ms"] = bench(lambda: rms_norm_quant(x, norm, 1e-6))
    row["quantize_rows_ms"] = bench(lambda: quantize_rows(inner))
    row["swiglu_fp8_over_bf16"] = row["swiglu_bf16_ms"] / row["swiglu_fp8_ms"]
    row["qkv_fp8_over_bf16"] = row["qkv_bf16_ms"] / row["qkv_fp8_ms"]
    swiglu_ref = swiglu_matmul_reference(codes, gate_up8, x_scale=scale, w_scale=gate_up_scale).float()
    row["swiglu_fp8_max_abs_diff"] = float((gemms["swiglu_fp8"][0]().float() - swiglu_ref).abs().max())
    qkv_ref = qkv_rope_matmul_reference(codes, qkv8, None, *rope_args, x_scale=scale, w_scale=qkv_scale).float()
    row["qkv_fp8_max_abs_diff"] = float((gemms["qkv_fp8"][0]().float() - qkv_ref).abs().max())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.6b,4b,8b")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    rows = []
    for shape in args.shapes.split(","):
        for tokens in TOKENS:
            try:
                rows.append(run_shape(shape, tokens))
            except Exception as error:  # noqa: BLE001 - one failing kernel must not hide the other rows
                rows.append({"shape": shape, "tokens": tokens, "error": f"{type(error).__name__}: {error}"[:500]})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'shape':<6}{'tokens':>7} | {'TFLOP/s: swiglu fp8':>19}{'bf16':>6}{'cuBLAS8':>8} | {'qkv fp8':>8}"
          f"{'bf16':>6}{'cuBLAS8':>8} | {'down fp8':>9}{'bf16':>6} | {'normq us':>9}{'quant us':>9}")
    for row in rows:
        if "error" in row:
            print(f"{row['shape']:<6}{row['tokens']:>7} | {row['error'][:90]}")
            continue
        print(f"{row['shape']:<6}{row['tokens']:>7} | {row['swiglu_fp8_tflops']:>19.0f}"
              f"{row['swiglu_bf16_tflops']:>6.0f}"
              f"{row['swiglu_scaled_mm_tflops']:>8.0f} | {row['qkv_fp8_tflops']:>8.0f}{row['qkv_bf16_tflops']:>6.0f}"
              f"{row['qkv_scaled_mm_tflops']:>8.0f} | {row['down_scaled_mm_tflops']:>9.0f}"
              f"{row['down_bf16_tflops']:>6.0f} | {1000 * row['rms_norm_quant_ms']:>9.1f}"
              f"{1000 * row['quantize_rows_ms']:>9.1f}")
    from rerankit.kernels import _TUNED  # what the tuners chose, per kernel and key (token bucket last)

    for (_, key), config in _TUNED.items():
        print(json.dumps({"tuned": [str(part) for part in key], "config": str(config)}))
    if args.out:
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
