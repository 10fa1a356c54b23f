"""Probe: Triton's automatic warp specialization on Hopper, LI's attention parts, and the host's tokenizer (GPU).

Warp specialization (``tl.range(..., warp_specialize=True)``) splits a loop into a copy warpgroup and MMA/softmax
warpgroups, as FlashAttention-3 does by hand. On Hopper, Triton 3.6 compiles it only for single-loop kernels whose
every load is a tensor-descriptor load (the engine's attention kernel, with its several key loops, a pointer-loaded Q
and an early exit, fails in the compiler). This probe times, ms (median, triton do_bench), on the GPU at hand:
- LI's attention pack with its head kept (1,024 kept keys, a 52-token prefix in the batch, 100 items of 146 tokens,
  Qwen3-0.6B heads): the engine's kernel; the same pack without the kept keys (prefix and own spans only); a dense
  pass of every query over the kept keys (out and log-sum-exp written), plain and warp-specialized, next to cuDNN
  and flash SDPA;
- the SwiGLU gate/up GEMM at W3 / LI / W1 sizes: the engine's descriptor kernel, and a persistent two-accumulator
  variant (separate gate/up loads, a pointer store: the form the specializer accepts), plain and warp-specialized.
Every warp-specialized variant runs in a subprocess of its own, killed after ``--variant-timeout`` seconds: on the
H100 of 2026-11-25 both hung (see docs/engine.md). Also the host's CPUs and the tokenizer on LI's items.

    PYTHONPATH=src python benchmarks/ws_probe.py [--out bench_out/ws_probe.jsonl] [--parts host attention swiglu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

from rerankit.kernels.attention_config import CUDA_DEFAULT_CONFIG
from rerankit.kernels.prefix_attention import prefix_attention
from rerankit.kernels.swiglu_matmul import _tile, swiglu_matmul, swiglu_matmul_reference  # _tile: tile order

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from packs import pack_meta  # noqa: E402

HQ, HKV, D = 16, 8, 128
KEPT, PREFIX, ITEM, ITEMS = 1024, 52, 146, 100
# (block_m, block_n, warps, stages, warp_specialize); a specialized kernel's warps are per warpgroup role.
KEPT_KEYS_CONFIGS = [(128, 64, 8, 3, False), (128, 128, 8, 2, False), (64, 64, 4, 3, False), (128, 64, 4, 2, True)]
# (block_m, block_n, block_k, warps, stages, warp_specialize)
SWIGLU_CONFIGS = [(128, 128, 64, 8, 3, False), (128, 128, 64, 4, 3, True)]


@triton.jit
def _kept_keys_kernel(q_desc, k_desc, v_desc, out_ptr, lse_ptr, n_tok, n_keys, qk_scale, stride_ot, stride_lt,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                      WS: tl.constexpr):
    """Every query of BLOCK_M tokens of one head against the first n_keys keys: out (normalized) and lse (log2)."""
    t0 = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    kv_col = (head // GROUP) * HEAD_DIM
    q = q_desc.load([t0, head * HEAD_DIM])
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    scale = qk_scale * 1.4426950408889634
    for start in tl.range(0, n_keys, BLOCK_N, warp_specialize=WS):
        k = k_desc.load([start, kv_col])
        qk = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk * scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([start, kv_col])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    rows = t0 + tl.arange(0, BLOCK_M)
    ok = rows < n_tok
    tl.store(lse_ptr + rows * stride_lt + head, m_i + tl.math.log2(l_i), mask=ok)
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + rows[:, None] * stride_ot + head * HEAD_DIM + offs_d[None, :],
             (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=ok[:, None])


def kept_keys(q, ck, cv, block_m, block_n, warps, stages, ws):
    """The dense kept-keys pass: (out [T, Hq, D], lse [T, Hq] in log2)."""
    tokens = q.shape[0]
    q2, k2, v2 = q.reshape(tokens, -1), ck.reshape(ck.shape[0], -1), cv.reshape(cv.shape[0], -1)
    out = torch.empty_like(q2)
    lse = torch.empty(tokens, HQ, device=q.device, dtype=torch.float32)
    q_desc = TensorDescriptor.from_tensor(q2, [block_m, D])
    k_desc, v_desc = (TensorDescriptor.from_tensor(x, [block_n, D]) for x in (k2, v2))
    _kept_keys_kernel[(triton.cdiv(tokens, block_m), HQ)](
        q_desc, k_desc, v_desc, out, lse, tokens, ck.shape[0], D ** -0.5, out.stride(0), lse.stride(0),
        GROUP=HQ // HKV, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=D, WS=ws, num_warps=warps, num_stages=stages)
    return out.view_as(q), lse


@triton.jit
def _swiglu_two_kernel(x_desc, w_desc, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, WS: tl.constexpr):
    """Persistent SwiGLU with two accumulators fed by separate gate/up loads and a pointer store (autoWS-friendly)."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=not WS, warp_specialize=WS):
        pid_m, pid_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(steps):
            a = x_desc.load([pid_m * BLOCK_M, step * BLOCK_K])
            gate = tl.dot(a, w_desc.load([pid_n * BLOCK_N, step * BLOCK_K]).T, gate)
            up = tl.dot(a, w_desc.load([N + pid_n * BLOCK_N, step * BLOCK_K]).T, up)
        gate = gate.to(tl.bfloat16).to(tl.float32)
        up = up.to(tl.bfloat16).to(tl.float32)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
                 (gate / (1.0 + tl.exp(-gate)) * up).to(tl.bfloat16), mask=rows[:, None] < M)


def swiglu_two(x, weight, block_m, block_n, block_k, warps, stages, ws):
    """The two-accumulator variant, one program per SM."""
    tokens, width = x.shape[0], weight.shape[0] // 2
    out = torch.empty(tokens, width, dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    programs = min(sms, triton.cdiv(tokens, block_m) * triton.cdiv(width, block_n))
    _swiglu_two_kernel[(programs,)](x_desc, w_desc, out, tokens, width, x.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
                                    BLOCK_K=block_k, GROUP_M=8, NUM_SMS=programs, WS=ws, num_warps=warps,
                                    num_stages=stages)
    return out


def emit(row: dict, sink) -> None:
    print(json.dumps(row), flush=True)
    if sink:
        sink.write(json.dumps(row) + "\n")
        sink.flush()


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def li_pack():
    """LI's pack as the engine runs it with the head kept: q/k/v as views of one projection, the kept keys."""
    torch.manual_seed(0)
    meta = pack_meta([(PREFIX, [ITEM] * ITEMS)], "cuda")
    tokens = meta["span_starts"].numel()
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :HQ * D].view(tokens, HQ, D)
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(tokens, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(tokens, HKV, D)
    kept = torch.randn(KEPT, 2 * HKV * D, device="cuda", dtype=torch.bfloat16)
    ck, cv = kept[:, :HKV * D].view(KEPT, HKV, D), kept[:, HKV * D:].view(KEPT, HKV, D)
    return q, k, v, ck, cv, meta


def kept_keys_row(q, ck, cv, expected, index: int) -> dict:
    block_m, block_n, warps, stages, ws = KEPT_KEYS_CONFIGS[index]
    out, _ = kept_keys(q, ck, cv, block_m, block_n, warps, stages, ws)
    ms = bench(lambda: kept_keys(q, ck, cv, block_m, block_n, warps, stages, ws))
    return {"part": "attention", "what": f"kept keys dense, triton m{block_m} n{block_n} w{warps} s{stages}"
            f"{' ws' if ws else ''}", "ms": ms, "tflops": 4 * q.shape[0] * HQ * KEPT * D / ms / 1e9,
            "max_abs_diff": (out.float() - expected.float()).abs().max().item()}


def attention_rows(sink, variant: int | None, timeout: float) -> None:
    q, k, v, ck, cv, meta = li_pack()
    heads_first = [x.transpose(0, 1)[None] for x in (q, ck, cv)]
    expected = F.scaled_dot_product_attention(*heads_first, enable_gqa=True)[0].transpose(0, 1)
    if variant is not None:
        emit(kept_keys_row(q, ck, cv, expected, variant), sink)
        return
    args = (q, k, v, meta["cu_seqlens"], meta["max_seqlen"], meta["prefix_lens"], meta["span_starts"])
    cached = (torch.tensor([KEPT], dtype=torch.int32, device="cuda"), ck, cv)
    full_keys, spans_keys = KEPT + PREFIX + (ITEM + 1) / 2, PREFIX + (ITEM + 1) / 2
    emit({"part": "attention", "what": "engine kernel: kept keys + prefix + own spans", "ms": bench(
        lambda: prefix_attention(*args, keys_per_query=full_keys, cached=cached))}, sink)
    emit({"part": "attention", "what": "prefix + own spans only, the engine's long-keys tile", "ms": bench(
        lambda: prefix_attention(*args, keys_per_query=full_keys))}, sink)
    emit({"part": "attention", "what": "prefix + own spans only, the short-span tile", "ms": bench(
        lambda: prefix_attention(*args, keys_per_query=spans_keys, config=CUDA_DEFAULT_CONFIG))}, sink)
    for index, config in enumerate(KEPT_KEYS_CONFIGS):
        if config[-1]:
            guarded(sink, "attention", index, config, timeout)
        else:
            emit(kept_keys_row(q, ck, cv, expected, index), sink)
    repeated = [x.repeat_interleave(HQ // HKV, 1) for x in heads_first[1:]]
    for name, backend in [("cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
                          ("flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION)]:
        try:
            with torch.nn.attention.sdpa_kernel(backend):
                ms = bench(lambda: F.scaled_dot_product_attention(heads_first[0], *repeated))
            emit({"part": "attention", "what": f"kept keys dense, {name} SDPA", "ms": ms,
                  "tflops": 4 * q.shape[0] * HQ * KEPT * D / ms / 1e9}, sink)
        except RuntimeError as error:  # a backend this build lacks
            emit({"part": "attention", "what": f"kept keys dense, {name} SDPA", "error": str(error)[:300]}, sink)


def swiglu_rows(sink, variant: int | None, timeout: float) -> None:
    hidden, width = 1024, 3072
    torch.manual_seed(0)
    weight = (torch.randn(2 * width, hidden, device="cuda") / hidden ** 0.5).bfloat16()
    configs = range(len(SWIGLU_CONFIGS)) if variant is None else [variant]
    for tokens in (5120, 14652, 26624):
        x = torch.randn(tokens, hidden, device="cuda").bfloat16()
        expected = swiglu_matmul_reference(x, weight)
        flop = 2 * tokens * hidden * 2 * width
        if variant is None:
            ms = bench(lambda: swiglu_matmul(x, weight))
            emit({"part": "swiglu", "tokens": tokens, "what": "engine descriptor kernel", "ms": ms,
                  "tflops": flop / ms / 1e9}, sink)
        for index in configs:
            config = SWIGLU_CONFIGS[index]
            if config[-1] and variant is None:
                continue  # specialized variants run below, each in a subprocess
            out = swiglu_two(x, weight, *config)
            ms = bench(lambda: swiglu_two(x, weight, *config))
            emit({"part": "swiglu", "tokens": tokens,
                  "what": "two accumulators m{} n{} k{} w{} s{}{}".format(*config[:5], " ws" if config[5] else ""),
                  "ms": ms, "tflops": flop / ms / 1e9,
                  "max_abs_diff": (out.float() - expected.float()).abs().max().item()}, sink)
    if variant is None:
        for index, config in enumerate(SWIGLU_CONFIGS):
            if config[-1]:
                guarded(sink, "swiglu", index, config, timeout)


def guarded(sink, part: str, index: int, config: tuple, timeout: float) -> None:
    """One warp-specialized variant in a subprocess of its own, killed after ``timeout`` seconds."""
    command = [sys.executable, __file__, "--parts", part, "--variant", str(index)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        emit({"part": part, "config": config, "error": f"did not finish in {timeout:.0f} s (compile and run)"}, sink)
        return
    for line in done.stdout.splitlines()[1:]:
        emit(json.loads(line), sink)
    if done.returncode:
        emit({"part": part, "config": config, "error": done.stderr[-300:]}, sink)


def tokenizer_ms() -> dict:
    """The tokenizer's time on LI's 100 items (median of 40 batched calls), as the engine calls it."""
    import random
    import statistics
    import tempfile
    import time

    from pairs import make_docs, single_token_words
    from tiny_models import build_decoder_tokenizer
    from transformers import AutoTokenizer

    folder = Path(tempfile.mkdtemp(prefix="rerankit-tokenizer-"))
    build_decoder_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    docs = make_docs(single_token_words(tokenizer), ITEMS, 128, 129, random.Random(0))
    times = []
    for _ in range(40):
        start = time.perf_counter()
        ids = [e.ids for e in tokenizer.backend_tokenizer.encode_batch_fast(docs, add_special_tokens=False)]
        times.append(time.perf_counter() - start)
    return {"tokens": sum(map(len, ids)), "ms": statistics.median(times) * 1e3}


def host_rows(sink) -> None:
    """The host's CPUs, and the tokenizer on LI's items with all threads, one and four (a process each: the
    tokenizer's thread pool is sized once per process)."""
    quota = Path("/sys/fs/cgroup/cpu.max")
    emit({"part": "host", "nproc": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
          "cpu.max": quota.read_text().strip() if quota.exists() else None}, sink)
    for threads in (None, "1", "4"):
        env = dict(os.environ)
        if threads:
            env["RAYON_NUM_THREADS"] = threads
        done = subprocess.run([sys.executable, __file__, "--tokenizer-only"], capture_output=True, text=True,
                              env=env)
        row = json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else {"error": done.stderr[-300:]}
        emit({"part": "host", "what": f"tokenizer, LI items, RAYON_NUM_THREADS={threads}", **row}, sink)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--parts", nargs="+", choices=("host", "attention", "swiglu"),
                        default=["host", "attention", "swiglu"])
    parser.add_argument("--variant-timeout", type=float, default=120.0)
    parser.add_argument("--variant", type=int, default=None, help=argparse.SUPPRESS)  # a guarded subprocess
    parser.add_argument("--tokenizer-only", action="store_true", help=argparse.SUPPRESS)  # host_rows' subprocess
    args = parser.parse_args()
    if args.tokenizer_only:
        print(json.dumps(tokenizer_ms()))
        return
    sink = None
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        sink = args.out.open("w")
    emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}, sink)
    for part in args.parts:
        if part == "host":
            host_rows(sink)
        else:
            {"attention": attention_rows, "swiglu": swiglu_rows}[part](sink, args.variant, args.variant_timeout)


if __name__ == "__main__":
    main()
