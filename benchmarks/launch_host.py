"""Host time of Triton launches, Triton's own path (``kernel[grid](...)``) against ``kernels.direct_launch`` (GPU).

Part 1, per kernel: each per-layer kernel's wrapper at Qwen3-0.6B's shape (hidden 1,024, 16 q heads, 8 kv heads, head
128, intermediate 3,072) on ``--tokens`` tokens, bf16 and FP8 where the kernel takes them: host microseconds a call
(``--calls`` calls queued back to back, median of ``--rounds`` rounds, the two paths interleaved), the Triton
launches a call makes, and whether the two paths' outputs are the same bits.

Part 2, a forward: one eager ``forward_read`` of the largest micro-batch of W1 (``pairs.py``'s workload: 1 query x
100 docs) on a random-weight Qwen3 of the 0.6B shape with ``--layers`` layers, bf16 and FP8 engines, with
RERANKIT_DIRECT_LAUNCH=0 and =1 in turn, or ``--toggle``'s variable (read on each launch): host ms to launch it,
GPU ms (the forward queued behind a GPU sleep longer than its launches, so the GPU runs it without waiting on the
host) and wall ms (launch, then wait for the GPU); then whether the hidden states and a ``score_batch``'s scores are
the same bits.

    PYTHONPATH=src:tests python benchmarks/launch_host.py [--tokens 22528] [--calls 40] [--rounds 5] [--layers 4]
        [--skip-kernels] [--skip-forward] [--dtypes bfloat16,fp8] [--toggle RERANKIT_LAUNCH_REPLAY]

Prints one JSON object per measurement, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from rerankit.kernels import direct_launch  # noqa: E402
from rerankit.kernels.direct_launch import ENV  # noqa: E402

EPS = 1e-6
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 1024, 16, 8, 128, 3072


TOGGLED = [ENV]  # the variable part 2 turns off and on (--toggle)


def set_direct(on: bool) -> None:
    os.environ[ENV] = "1" if on else "0"


def set_toggle(on: bool) -> None:
    """Part 2's variable (``--toggle``) set; the direct path on where another variable is toggled."""
    os.environ[ENV] = "1"
    os.environ[TOGGLED[0]] = "1" if on else "0"


def triton_runs(call) -> int:
    """Launches through ``JITFunction.run`` (Triton's own path) of one ``call()``, with the direct path off."""
    from triton.runtime.jit import JITFunction

    runs, original = [], JITFunction.run

    def counting(self, *args, **kwargs):
        runs.append(self)
        return original(self, *args, **kwargs)

    set_direct(False)
    JITFunction.run = counting
    try:
        call()
    finally:
        JITFunction.run = original
    return len(runs)


def same_bits(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    if not isinstance(a, torch.Tensor):
        return a == b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def w1_layout(tokens: int, prefix: int = 76) -> list[tuple[int, list[int]]]:
    """MIS sequences of W1's kind (a ``prefix``-token head, then items of 64..447 tokens) up to ``tokens`` tokens."""
    items = [64 + 37 * i % 384 for i in range(100)]
    layout, total = [], 0
    while True:
        spans = []
        for length in items:
            if total + prefix * (not spans) + length > tokens:
                break
            total += length + prefix * (not spans)
            spans.append(length)
        if not spans:
            return layout
        layout.append((prefix, spans))


def kernel_cases(tokens: int, device: str = "cuda") -> list[tuple[str, str, object, object]]:
    """(kernel, dtype, timed call, call for the bit check) of each per-layer kernel's wrapper at the 0.6B shape (on
    the CPU, without the interpreter: the wrappers' torch references, to check the script)."""
    from packs import pack_meta

    from rerankit.kernels import fp8_quant, label_logprobs, prefix_attention, qk_norm_rope, qkv_rope_matmul, rms_norm
    from rerankit.kernels import swiglu_matmul

    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    meta = pack_meta(w1_layout(tokens), device)
    total = int(meta["cu_seqlens"][-1])
    x, residual, delta, norm = rand(total, HIDDEN), rand(total, HIDDEN), rand(total, HIDDEN), rand(HIDDEN) + 1
    qkv = rand(total, width)
    q, k, v = (qkv[:, a:b].unflatten(1, (-1, HEAD_DIM)) for a, b in
               ((0, HEADS * HEAD_DIM), (HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM),
                ((HEADS + KV_HEADS) * HEAD_DIM, width)))
    positions = torch.arange(total, device=device) % 512
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM)
    cos, sin = qkv_rope_matmul.rope_table(positions, inv_freq)
    q_norm, k_norm = norm[:HEAD_DIM], norm[HEAD_DIM:2 * HEAD_DIM]
    w_qkv, w_gate_up = rand(width, HIDDEN, scale=HIDDEN ** -0.5), rand(2 * INTERMEDIATE, HIDDEN, scale=HIDDEN ** -0.5)
    codes, x_scale, lengths = fp8_quant.rms_norm_quant(x, norm, EPS, sumsq=True)
    qkv8, qkv_scale = fp8_quant.quantize_rows_reference(w_qkv)
    gate_up8, gate_up_scale = fp8_quant.quantize_rows_reference(w_gate_up)
    bound = swiglu_matmul.swiglu_bound(gate_up8, gate_up_scale)  # a host sync: once, here
    v_bound = fp8_quant.abs_max(v)
    hidden, lm_head = rand(100, HIDDEN), rand(151669, HIDDEN, scale=HIDDEN ** -0.5)
    labels = torch.randint(0, 151669, (100, 2), generator=gen, device=device)
    attended = rand(total, HEADS * HEAD_DIM)
    cases = [
        ("rms_norm", "bf16", lambda: rms_norm.rms_norm(x, norm, EPS)),
        ("qkv_rope_matmul", "bf16", lambda: qkv_rope_matmul.qkv_rope_matmul(
            x, w_qkv, None, HEADS, KV_HEADS, HEAD_DIM, cos, sin, q_norm, k_norm, EPS)),
        ("qk_norm_rope", "bf16", lambda: qk_norm_rope.qk_norm_rope(
            qkv, HEADS, KV_HEADS, HEAD_DIM, positions, inv_freq, q_norm, k_norm, EPS)),
        ("prefix_attention", "bf16", lambda: prefix_attention.prefix_attention(q, k, v, **meta)),
        ("swiglu_matmul", "bf16", lambda: swiglu_matmul.swiglu_matmul(x, w_gate_up)),
        ("add_rms_norm_quant", "fp8", lambda: fp8_quant.add_rms_norm_quant(residual, delta, norm, EPS, sumsq=True),
         lambda: fp8_quant.add_rms_norm_quant(residual.clone(), delta, norm, EPS, sumsq=True)),
        ("rms_norm_quant", "fp8", lambda: fp8_quant.rms_norm_quant(x, norm, EPS, sumsq=True)),
        ("qkv_rope_matmul", "fp8", lambda: qkv_rope_matmul.qkv_rope_matmul(
            codes, qkv8, None, HEADS, KV_HEADS, HEAD_DIM, cos, sin, q_norm, k_norm, EPS, x_scale=x_scale,
            w_scale=qkv_scale)),
        ("abs_max", "fp8", lambda: fp8_quant.abs_max(v)),
        ("prefix_attention fp8 out", "fp8", lambda: prefix_attention.prefix_attention(q, k, v, **meta,
                                                                                      fp8_bound=v_bound)),
        ("quantize_bounded", "fp8", lambda: fp8_quant.quantize_bounded(attended, v_bound)),
        ("quantize_rows", "fp8", lambda: fp8_quant.quantize_rows(attended)),
        ("swiglu_matmul_fp8_out", "fp8", lambda: swiglu_matmul.swiglu_matmul_fp8_out(
            codes, gate_up8, x_scale, gate_up_scale, lengths, bound)),
        ("label_logprobs (once a forward)", "bf16", lambda: label_logprobs.label_logprobs(hidden, lm_head, labels)),
    ]
    return [(name, dtype, timed, check[0] if check else timed) for name, dtype, timed, *check in cases]


def host_us(call, calls: int) -> float:
    """Host microseconds a call, ``calls`` calls queued without waiting on the GPU (which is idle at the start)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def kernel_rows(args) -> list[dict]:
    rows = []
    for name, dtype, timed, check in kernel_cases(args.tokens):
        try:
            for on in (False, True, True):  # compiled, tuned, and (direct) kept before timing
                set_direct(on)
                timed()
            set_direct(False)
            expected = check()
            set_direct(True)
            check()
            got = check()
            launches = triton_runs(timed)
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.rounds):
                for on in (False, True):
                    set_direct(on)
                    times[on].append(host_us(timed, args.calls))
            stock, direct = statistics.median(times[False]), statistics.median(times[True])
            row = {"kernel": name, "dtype": dtype, "tokens": args.tokens, "launches": launches,
                   "stock_us": round(stock, 1), "direct_us": round(direct, 1),
                   "saved_us_a_launch": round((stock - direct) / max(launches, 1), 1),
                   "same_bits": same_bits(expected, got)}
        except Exception as error:  # one kernel's failure (another file's API moved) does not stop the others
            traceback.print_exc()
            row = {"kernel": name, "dtype": dtype, "error": f"{type(error).__name__}: {error}"[:200]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def sleep_cycles_a_ms() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` a millisecond, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    torch.cuda.synchronize()
    return 50_000_000 / start.elapsed_time(end)


def forward_rows(args) -> list[dict]:
    from pairs import SHAPES, build_decoder_dir, decoder_workloads, requests_of, single_token_words
    from transformers import AutoTokenizer

    from rerankit.engine import EmbeddedBackend
    from rerankit.engine.backend import _Call

    shape = f"0.6b-{args.layers}-layers"
    SHAPES[shape] = {**SHAPES["0.6b"], "num_hidden_layers": args.layers}
    folder = build_decoder_dir(Path(tempfile.mkdtemp(prefix="rerankit-launch-host-")), shape)
    words = single_token_words(AutoTokenizer.from_pretrained(folder))
    requests = requests_of(decoder_workloads(words, random.Random(0), {"W1"})[0], True)
    cycles_a_ms = sleep_cycles_a_ms()
    rows = []
    for dtype in args.dtypes.split(","):
        try:
            set_toggle(False)
            backend = EmbeddedBackend(str(folder), device="cuda", dtype=dtype)
            loaded = backend._model()
            for on in (False, True, True):
                set_toggle(on)
                backend.score_batch(requests)
            runner, model = backend._runner, backend._runner.model
            micro = max(backend._plan(_Call(requests), loaded, False), key=lambda m: m.batch.num_tokens)
            batch = runner._on_device(micro.batch)
            kept = None if batch.cached_head is None else runner.prefix_cache.get(batch.cached_head,
                                                                                   model.keep_prefix)
            forward = lambda: model.forward_read(batch, cached_kv=kept)  # noqa: E731
            outputs, times = {}, {False: [], True: []}
            for on in (False, True):
                set_toggle(on)
                forward()
                outputs[on] = forward()
            torch.cuda.synchronize()
            for _ in range(args.rounds):
                for on in (False, True):
                    set_toggle(on)
                    times[on].append(time_forward(forward, cycles_a_ms))
            scores = {}
            for on in (False, True):
                set_toggle(on)
                scores[on] = [[r.score for r in response.results] for response in backend.score_batch(requests)]
            for on in (False, True):
                host, gpu, wall = (statistics.median(t[i] for t in times[on]) for i in range(3))
                row = {"forward": f"{args.layers} layers", "dtype": dtype, TOGGLED[0]: int(on),
                       "tokens": batch.num_tokens, "host_ms": round(host, 2), "gpu_ms": round(gpu, 2),
                       "wall_ms": round(wall, 2), "same_hidden_bits": same_bits(outputs[False], outputs[True]),
                       "same_scores": scores[False] == scores[True]}
                print(json.dumps(row), flush=True)
                rows.append(row)
            backend.close()
            backend = runner = model = forward = None  # the next engine's memory
            torch.cuda.empty_cache()
        except Exception as error:
            traceback.print_exc()
            row = {"forward": f"{args.layers} layers", "dtype": dtype, "error": f"{type(error).__name__}: {error}"}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def time_forward(forward, cycles_a_ms: float) -> tuple[float, float, float]:
    """(host ms to launch, GPU ms alone, wall ms launched then waited for) of one ``forward()``."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    forward()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(cycles_a_ms * (2e3 * host + 5)))  # the host queues the whole forward behind it
    began.record()
    forward()
    ended.record()
    torch.cuda.synchronize()
    return 1e3 * host, began.elapsed_time(ended), 1e3 * wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=22528, help="tokens of the per-kernel calls")
    parser.add_argument("--calls", type=int, default=40, help="calls queued a timing")
    parser.add_argument("--rounds", type=int, default=5, help="timings of each path, interleaved")
    parser.add_argument("--layers", type=int, default=4, help="layers of the random Qwen3 of the forward")
    parser.add_argument("--dtypes", default="bfloat16,fp8", help="engine dtypes of the forward")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-forward", action="store_true")
    parser.add_argument("--toggle", default=ENV, help="the variable part 2 sets to 0 and 1 in turn, e.g. "
                        "RERANKIT_LAUNCH_REPLAY (the direct path then stays on)")
    args = parser.parse_args()
    TOGGLED[0] = args.toggle
    if not torch.cuda.is_available():
        sys.exit("launch_host.py times CUDA launches: no CUDA device here")
    import triton

    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": triton.__version__, "python": sys.version.split()[0],
                      "direct_launch_available": direct_launch.available()}), flush=True)
    if not direct_launch.available():
        print("direct launches are off on this triton: both columns time Triton's own path", flush=True)
    kernels = [] if args.skip_kernels else kernel_rows(args)
    forwards = [] if args.skip_forward else forward_rows(args)
    os.environ.pop(ENV, None)
    print(f"\n{'kernel':34} {'dtype':5} {'launches':>8} {'stock us':>9} {'direct us':>9} {'saved/launch':>12} bits")
    for row in kernels:
        if "error" in row:
            print(f"{row['kernel']:34} {row['dtype']:5} error: {row['error']}")
            continue
        print(f"{row['kernel']:34} {row['dtype']:5} {row['launches']:8} {row['stock_us']:9.1f} "
              f"{row['direct_us']:9.1f} {row['saved_us_a_launch']:12.1f} {'same' if row['same_bits'] else 'DIFFER'}")
    print(f"\n{'forward':10} {'dtype':8} {'tokens':>6} {'on':>6} {'host ms':>8} {'gpu ms':>7} {'wall ms':>8} "
          f"hidden scores")
    for row in forwards:
        if "error" in row:
            print(f"{row['forward']:10} {row['dtype']:8} error: {row['error']}")
            continue
        print(f"{row['forward']:10} {row['dtype']:8} {row['tokens']:6} {row[TOGGLED[0]]:>6} {row['host_ms']:8.2f} "
              f"{row['gpu_ms']:7.2f} {row['wall_ms']:8.2f} {'same' if row['same_hidden_bits'] else 'DIFFER':6} "
              f"{'same' if row['same_scores'] else 'DIFFER'}")


if __name__ == "__main__":
    main()
