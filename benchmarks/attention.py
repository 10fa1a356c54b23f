"""Packed / shared-prefix attention, one layer of Qwen3-0.6B shape (Hq=16, Hkv=8, D=128), bf16, GPU.

Every backend of rerankit.engine.attention on the same packs; time per layer (median ms) and TFLOP/s
counting only the query-key pairs the mask lets through. Prints a table, writes JSON.

    PYTHONPATH=src python benchmarks/attention.py --out bench_out/attention.json [--sweep]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from triton.testing import do_bench

from rerankit.engine.attention import available_backends, build_block_mask, packed_attention
from rerankit.engine.batch import PackedBatch
from rerankit.kernels.prefix_attention import AttentionConfig, prefix_attention

Q_HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
W1_PREFIX = 76  # Qwen3-Reranker template + a short query


def make_batch(layout, device="cuda") -> PackedBatch:
    """A PackedBatch for ``layout``: one (prefix_len, item_lens) per sequence; (0, [n]) is a plain sequence."""
    cu, prefix_lens, span_starts = [0], [], []
    for prefix_len, item_lens in layout:
        seq_start = cu[-1]
        span_starts += [seq_start] * prefix_len
        item_start = seq_start + prefix_len
        for item_len in item_lens:
            span_starts += [item_start] * item_len
            item_start += item_len
        cu.append(item_start)
        prefix_lens.append(prefix_len)
    total = cu[-1]
    as_int = dict(dtype=torch.int32, device=device)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return PackedBatch(
        input_ids=torch.zeros(total, dtype=torch.int64, device=device),
        position_ids=torch.zeros(total, dtype=torch.int64, device=device),
        cu_seqlens=torch.tensor(cu, **as_int),
        max_seqlen=max(end - start for start, end in zip(cu[:-1], cu[1:])),
        prefix_lens=torch.tensor(prefix_lens, **as_int),
        span_starts=torch.tensor(span_starts, **as_int),
        read_positions=empty, item_indices=empty, request_ids=empty,
    )


def visible_pairs(batch: PackedBatch) -> int:
    """Number of (query, key) pairs the mask allows: per token, its prefix keys plus its own span up to itself."""
    cu = batch.cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    seq_start = torch.repeat_interleave(cu[:-1], lengths)
    prefix_end = seq_start + torch.repeat_interleave(batch.prefix_lens.long(), lengths)
    span_start = batch.span_starts.long()
    token = torch.arange(batch.num_tokens, device=cu.device)
    return int((torch.minimum(prefix_end, span_start) - seq_start + token - span_start + 1).sum())


def workloads(seed: int = 0) -> dict[str, list]:
    rng = random.Random(seed)
    w1_items = [rng.randrange(64, 448) for _ in range(100)]
    doc_lens, left = [], 32768
    while left:
        doc_lens.append(min(left, rng.randrange(256, 4096)))
        left -= doc_lens[-1]
    return {
        "w1 plain: 100 x (76 + 64..448)": [(0, [W1_PREFIX + n]) for n in w1_items],
        "w1 MIS: 76 + 100 items": [(W1_PREFIX, w1_items)],
        "prefix 1024, plain: 100 x (1024 + 128)": [(0, [1024 + 128])] * 100,
        "prefix 1024 MIS: 1024 + 100 x 128": [(1024, [128] * 100)],
        "32k doc-masked causal pack": [(0, [n]) for n in doc_lens],
    }


def bench_backend(q, k, v, batch, backend) -> float:
    return do_bench(lambda: packed_attention(q, k, v, batch, backend=backend), warmup=25, rep=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out/attention.json"))
    parser.add_argument("--sweep", action="store_true", help="also time the Triton kernel over tile configs")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": [], "sweep": []}
    backends = available_backends("cuda")
    for name, layout in workloads().items():
        batch = make_batch(layout)
        pairs = visible_pairs(batch)
        gflop = 4 * HEAD_DIM * Q_HEADS * pairs / 1e9
        q = torch.randn(batch.num_tokens, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch.num_tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        start = time.perf_counter()
        build_block_mask(batch)
        torch.cuda.synchronize()
        mask_ms = (time.perf_counter() - start) * 1e3
        ours = packed_attention(q, k, v, batch, backend="triton").float()
        for backend in backends:
            if backend == "varlen" and batch.is_multi_item:
                continue
            if backend == "sdpa" and batch.max_seqlen > 4096:
                continue  # a boolean mask per long sequence sends SDPA to its math path: minutes
            diff = (packed_attention(q, k, v, batch, backend=backend).float() - ours).abs().max().item()
            ms = bench_backend(q, k, v, batch, backend)
            results["rows"].append(dict(workload=name, backend=backend, tokens=batch.num_tokens, ms=ms,
                                        tflops=gflop / ms, max_abs_diff_vs_triton=diff,
                                        block_mask_build_ms=mask_ms if backend == "flex" else None))
        if args.sweep:
            for block_m, block_n, warps, stages in [(64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (128, 32, 4, 3),
                                                    (128, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3),
                                                    (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3)]:
                config = AttentionConfig(block_m, block_n, warps, stages)
                ms = do_bench(lambda: prefix_attention(q, k, v, batch.cu_seqlens, batch.max_seqlen, batch.prefix_lens,
                                                       batch.span_starts, config=config), warmup=25, rep=100)
                results["sweep"].append(dict(workload=name, config=config.__dict__, ms=ms, tflops=gflop / ms))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))

    print(f"device: {results['device']}, torch {results['torch']}; ms per layer, TFLOP/s over visible pairs")
    print(f"{'workload':42s} {'backend':8s} {'tokens':>7s} {'ms':>8s} {'TFLOP/s':>8s} {'max|diff|':>9s}")
    for row in results["rows"]:
        print(f"{row['workload']:42s} {row['backend']:8s} {row['tokens']:7d} {row['ms']:8.3f} {row['tflops']:8.1f} "
              f"{row['max_abs_diff_vs_triton']:9.4f}")
    for name in dict.fromkeys(row["workload"] for row in results["sweep"]):
        best = min((row for row in results["sweep"] if row["workload"] == name), key=lambda row: row["ms"])
        print(f"best triton config for {name}: {best['config']} {best['ms']:.3f} ms {best['tflops']:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
