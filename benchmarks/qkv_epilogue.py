"""What the FP8 q/k/v GEMM's epilogue costs (GPU): the kernel as shipped against variants of its epilogue.

``qkv_rope_matmul``'s epilogue norms each q and k head and rotates it by angles read from a float32 cos/sin table.
Triton loads that table in a layout of its own and moves it into the accumulator's through shared memory (32 KB a
tile), which also leaves no room for a third stage of 128-deep K steps. This times, ms (do_bench median, best tile
config of each), the FP8 kernel at the Qwen3 shapes and token counts of W1 / W4 micro-batches, as:
  shipped      ``qkv_rope_matmul``: from 2,048 tokens on sm_90 the warp-specialized Gluon kernel (``qkv_rope_ws``,
               the table read in the accumulator's layout);
  triton       ``qkv_rope_matmul`` with ``$RERANKIT_QKV_KERNEL=triton``: the Triton kernel, its tuned config;
  table        the Triton kernel's body over the configs below, config by config;
  no-table     constant angles instead of the table: what a table load in the accumulator's layout would save at most;
  approx-trig  angles computed in the kernel (position x inverse frequency) with the SFU's sin/cos after one turn
               is taken off: no table, but outputs one bf16 step off the reference in ~1e-4 of the elements;
  exact-trig   the same with libdevice's sin/cos, which are torch's (outputs equal the table's): slower;
  no-rope      scales and store only, no q/k norm and no rotation;
beside cuBLAS's FP8 GEMM alone (``fp8_matmul``) and followed by ``qk_norm_rope`` (the unfused path). Each variant's
largest difference from the shipped output and how many elements differ are printed too.

    PYTHONPATH=src python benchmarks/qkv_epilogue.py [--out bench_out/qkv_epilogue.jsonl]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
import tempfile
import textwrap
from pathlib import Path

import torch
import triton
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

from rerankit.kernels import qkv_rope_matmul as shipped_module
from rerankit.kernels.fp8_matmul import fp8_matmul
from rerankit.kernels.fp8_quant import quantize_rows_reference, rms_norm_quant
from rerankit.kernels.qk_norm_rope import qk_norm_rope
from rerankit.kernels.qkv_rope_matmul import KERNEL_ENV, qkv_rope_matmul, rope_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_calls import environment  # noqa: E402

SHAPES = {"0.6b": (1024, 16), "4b": (2560, 32), "8b": (4096, 32)}  # hidden size, q heads (8 kv heads of 128)
CASES = [("0.6b", 26624), ("0.6b", 4352), ("4b", 4096), ("4b", 8192), ("8b", 4096)]
# (heads a tile, K depth, stages): the shipped FP8 configs, and (2, 128, 3), which fits only without the shuffle
CONFIGS = [(2, 64, 5), (2, 64, 4), (2, 128, 2), (1, 128, 4), (2, 128, 3)]

TABLE = """            cos = tl.load(cos_ptr + table, mask=row_ok, other=0.0)[:, None, :]
            sin = tl.load(sin_ptr + table, mask=row_ok, other=0.0)[:, None, :]
"""
ANGLES = """            position = tl.load(cos_ptr + rows, mask=rows < M, other=0).to(tl.float32)  # positions [T]
            angle = position[:, None, None] * tl.load(sin_ptr + dims)[None, None, :]  # sin_ptr: inv_freq
"""
VARIANTS = {
    "table": TABLE,
    "no-table": """            cos = tl.full((BLOCK_M, 1, HALF), 0.6, tl.float32) + eps * 0.0
            sin = tl.full((BLOCK_M, 1, HALF), 0.8, tl.float32) + eps * 0.0
""",
    "approx-trig": ANGLES + """            turns = libdevice.rint(angle * 0.15915494309189535)
            turned = (angle - turns * 6.28125) - turns * 0.0019353071795864769  # 2 pi in two parts
            cos = tl.inline_asm_elementwise("cos.approx.ftz.f32 $0, $1;", "=r,r", [turned], dtype=tl.float32,
                                            is_pure=True, pack=1)
            sin = tl.inline_asm_elementwise("sin.approx.ftz.f32 $0, $1;", "=r,r", [turned], dtype=tl.float32,
                                            is_pure=True, pack=1)
""",
    "exact-trig": ANGLES + """            cos = libdevice.cos(angle)
            sin = libdevice.sin(angle)
""",
    "no-rope": TABLE,
}


def variant_kernel(name: str, folder: Path):
    """The shipped kernel body with its table loads replaced (or, for no-rope, its q/k branch switched off), as a
    module of its own: Triton reads a kernel's source from its file."""
    norm_rotate = textwrap.dedent(shipped_module._norm_rotate.src if hasattr(shipped_module._norm_rotate, "src")
                                  else inspect.getsource(shipped_module._norm_rotate.fn))
    norm_rotate = norm_rotate[norm_rotate.index("def "):]
    lines = norm_rotate.splitlines(keepends=True)
    first = [line.strip() for line in lines].index(TABLE.splitlines()[0].strip())
    if [line.strip() for line in lines[first:first + 2]] != [line.strip() for line in TABLE.splitlines()]:
        raise SystemExit("qkv_rope_matmul's table loads changed: update benchmarks/qkv_epilogue.py")
    indent = lines[first][:len(lines[first]) - len(lines[first].lstrip())]
    lines[first:first + 2] = [textwrap.indent(textwrap.dedent(VARIANTS[name]), indent)]
    norm_rotate = "".join(lines)
    if name == "no-rope":
        norm_rotate = norm_rotate.replace("if first_head < NUM_HEADS + NUM_KV_HEADS:", "if False:")
    body = textwrap.dedent(inspect.getsource(shipped_module._qkv_rope_body))
    source = ("import triton\nimport triton.language as tl\nfrom triton.language.extra import libdevice\n"
              "from rerankit.kernels.swiglu_matmul import grouped_tile\n\n\n@triton.jit\n" + norm_rotate + "\n\n"
              + body + "\n\nkernel = triton.jit(_qkv_rope_body)\n")
    path = folder / f"qkv_epilogue_{name.replace('-', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kernel


def run_case(shape: str, tokens: int, kernels: dict) -> dict:
    hidden, heads = SHAPES[shape]
    kv_heads, head_dim = 8, 128
    width = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    codes, x_scale = rms_norm_quant(x, (torch.rand(hidden, device="cuda") + 0.5).bfloat16(), 1e-6)
    weight, w_scale = quantize_rows_reference((torch.randn(width, hidden, device="cuda") / hidden ** 0.5).bfloat16())
    positions = torch.arange(tokens, device="cuda") % 4096
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim)
    cos, sin = rope_table(positions, inv_freq)
    q_norm = k_norm = (torch.rand(head_dim, device="cuda") + 0.5).bfloat16()
    rope = (heads, kv_heads, head_dim, cos, sin, q_norm, k_norm)
    shipped = lambda: qkv_rope_matmul(codes, weight, None, *rope, x_scale=x_scale, w_scale=w_scale)  # noqa: E731
    reference = shipped()
    with environment({KERNEL_ENV: "triton"}):
        triton_kernel = do_bench(shipped, return_mode="median")
        triton_output = shipped()
    row: dict = {"shape": shape, "tokens": tokens, "shipped": do_bench(shipped, return_mode="median"),
                 "triton": triton_kernel, "shipped equals triton": bool(torch.equal(reference, triton_output)),
                 "scaled_mm": do_bench(lambda: fp8_matmul(codes, x_scale, weight, w_scale), return_mode="median"),
                 "scaled_mm+qk_norm_rope": do_bench(lambda: qk_norm_rope(
                     fp8_matmul(codes, x_scale, weight, w_scale), heads, kv_heads, head_dim, positions, inv_freq,
                     q_norm, k_norm), return_mode="median")}
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    for name, kernel in kernels.items():
        angles = (positions, inv_freq) if name.endswith("trig") else (cos, sin)
        times = {}
        for tile_heads, block_k, stages in CONFIGS:
            block_n = tile_heads * head_dim
            out = torch.empty(tokens, width, dtype=torch.bfloat16, device="cuda")
            descriptors = (TensorDescriptor.from_tensor(codes, [128, block_k]),
                           TensorDescriptor.from_tensor(weight, [block_n, block_k]),
                           cos, x_scale, w_scale, TensorDescriptor.from_tensor(out, [128, block_n]))
            grid = (min(programs, triton.cdiv(tokens, 128) * triton.cdiv(width, block_n)),)
            launch = lambda: kernel[grid](  # noqa: E731
                *descriptors, *angles, q_norm, k_norm, tokens, width, hidden, 1e-6, HEAD_DIM=head_dim,
                NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HAS_BIAS=False, HAS_NORM=True, SCALED=True,
                NUM_SMS=programs, BLOCK_M=128, HEADS=tile_heads, BLOCK_K=block_k, GROUP_M=8, num_warps=8,
                num_stages=stages)
            config = f"{tile_heads}x{block_k}x{stages}"
            try:
                launch()
            except triton.runtime.errors.OutOfResources:
                times[config] = "out of shared memory"
                continue
            times[config] = do_bench(launch, return_mode="median")
            if name != "no-rope" and name != "no-table":
                diff = (out.float() - reference.float()).abs()
                row[f"{name} differs"] = [float(diff.max()), int((diff > 0).sum()), diff.numel()]
        row[name] = min(time for time in times.values() if isinstance(time, float))
        row[f"{name} by config"] = times
    flop = 2 * tokens * hidden * width
    row["tflops"] = {name: round(flop / row[name] / 1e9) for name in ("shipped", "triton", "scaled_mm", *kernels)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": triton.__version__}), flush=True)
    folder = Path(tempfile.mkdtemp(prefix="rerankit-qkv-epilogue-"))
    kernels = {name: variant_kernel(name, folder) for name in VARIANTS}
    rows = []
    for shape, tokens in CASES:
        rows.append(run_case(shape, tokens, kernels))
        print(json.dumps(rows[-1]), flush=True)
    names = ("shipped", "triton", *VARIANTS, "scaled_mm", "scaled_mm+qk_norm_rope")
    print(f"\n{'shape':<6}{'tokens':>7} | " + "".join(f"{name:>13}" for name in names) + "   (ms)")
    for row in rows:
        print(f"{row['shape']:<6}{row['tokens']:>7} | " + "".join(f"{row[name]:>13.4f}" for name in names))
    if args.out:
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
