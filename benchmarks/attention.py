"""Packed / shared-prefix attention, one layer, bf16, GPU.

Decoder packs in the Qwen3-0.6B shape (Hq=16, Hkv=8, D=128) and two in the 4B/8B heads (Hq=32, Hkv=8), plus a
BERT-large-shaped encoder pack (Hq=Hkv=16, D=64, bidirectional). Every backend of rerankit.engine.attention on the
same packs; time per layer (median ms) and TFLOP/s counting only the query-key pairs the mask lets through. Prints a
table, writes JSON. ``--sweep`` also times the Triton kernel over tile configs, one query head per program
and packed GQA (all query heads of a kv head per program), with its max |diff| against the default config; each
sweep result is printed as a JSON line as soon as it is measured, then one "best" line per pack.

    PYTHONPATH=src python benchmarks/attention.py --out bench_out/attention.json [--sweep] [--sweep-only]
        [--sweep-set all|tma|tiles|wide|defaults|gqa4] [--workloads MIS 32k encoder 4b]

The default config is rerankit.kernels.attention_config.default_config, so RERANKIT_ATTENTION_CONFIG applies to
the "triton" backend rows and to the sweep's reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from rerankit.engine.attention import available_backends, build_block_mask, packed_attention
from rerankit.engine.batch import PackedBatch
from rerankit.kernels.attention_config import CUDA_DEFAULT_CONFIG, CUDA_LONG_KEYS_CONFIG, AttentionConfig
from rerankit.kernels.prefix_attention import prefix_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from packs import pack_meta  # noqa: E402  (the tests' pack layouts)

QWEN3_0_6B = (16, 8, 128)  # query heads, key/value heads, head dim
QWEN3_4B = (32, 8, 128)  # also the 8B shape's heads: four query heads a kv head
BERT_LARGE = (16, 16, 64)
W1_PREFIX = 76  # Qwen3-Reranker template + a short query


def make_batch(layout, causal=True, device="cuda") -> PackedBatch:
    """A PackedBatch for ``layout``: one (prefix_len, item_lens) per sequence; (0, [n]) is a plain sequence."""
    meta = pack_meta(layout, device)
    total = meta["span_starts"].numel()
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    batch = PackedBatch(
        input_ids=torch.zeros(total, dtype=torch.int64, device=device),
        position_ids=torch.zeros(total, dtype=torch.int64, device=device),
        read_positions=empty, causal=causal, **meta,
    )
    batch.keys_per_query = visible_pairs(batch) / total  # as the planner sets it: the kernel's tiles depend on it
    return batch


def visible_pairs(batch: PackedBatch) -> int:
    """Number of (query, key) pairs the mask allows: per token, its prefix keys plus its own span up to itself."""
    cu = batch.cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    if not batch.causal:
        return int((lengths**2).sum())
    seq_start = torch.repeat_interleave(cu[:-1], lengths)
    prefix_end = seq_start + torch.repeat_interleave(batch.prefix_lens.long(), lengths)
    span_start = batch.span_starts.long()
    token = torch.arange(batch.num_tokens, device=cu.device)
    return int((torch.minimum(prefix_end, span_start) - seq_start + token - span_start + 1).sum())


def workloads(seed: int = 0) -> dict[str, tuple]:
    """name -> (layout, causal, attention shape)."""
    rng = random.Random(seed)
    w1_items = [rng.randrange(64, 448) for _ in range(100)]
    doc_lens, left = [], 32768
    while left:
        doc_lens.append(min(left, rng.randrange(256, 4096)))
        left -= doc_lens[-1]
    return {
        "w1 plain: 100 x (76 + 64..448)": ([(0, [W1_PREFIX + n]) for n in w1_items], True, QWEN3_0_6B),
        "w1 MIS: 76 + 100 items": ([(W1_PREFIX, w1_items)], True, QWEN3_0_6B),
        "prefix 1024, plain: 100 x (1024 + 128)": ([(0, [1024 + 128])] * 100, True, QWEN3_0_6B),
        "prefix 1024 MIS: 1024 + 100 x 128": ([(1024, [128] * 100)], True, QWEN3_0_6B),
        "LI MIS as planned: 1076 + 100 x 146": ([(1076, [146] * 100)], True, QWEN3_0_6B),
        "32k doc-masked causal pack": ([(0, [n]) for n in doc_lens], True, QWEN3_0_6B),
        "encoder D64: 100 x (76 + 64..448)": ([(0, [W1_PREFIX + n]) for n in w1_items], False, BERT_LARGE),
        # The 4B/8B heads on W1's documents: the first 32 (one call of 32 documents, ~8k tokens) and the 84 after
        # the ramp's first 16 (a call of 100 documents).
        "4b MIS: 76 + 32 items": ([(W1_PREFIX, w1_items[:32])], True, QWEN3_4B),
        "4b MIS: 76 + 84 items": ([(W1_PREFIX, w1_items[16:])], True, QWEN3_4B),
    }


SWEEP = [AttentionConfig(block_m, block_n, warps, stages) for block_m, block_n, warps, stages in [
    (128, 32, 4, 3), (128, 32, 4, 2), (128, 32, 4, 4), (128, 32, 8, 3), (64, 32, 4, 3), (64, 32, 4, 2),
    (64, 32, 2, 3), (64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4)]]
# Packed GQA: block_m tokens x GROUP heads per program (GROUP=2 on the Qwen3 packs: 64 or 128 MMA rows; 1 on the
# encoder, where it is the unpacked kernel on smaller tiles).
SWEEP += [AttentionConfig(block_m, block_n, warps, stages, pack_gqa=True)
          for block_m in (32, 64) for block_n in (32, 64) for warps in (4, 8) for stages in (2, 3)]
# K/V tiles through tensor descriptors (``tma``), next to the same tiles through pointers: ``--sweep-set tma``.
TMA_SWEEP = [dataclasses.replace(config, tma=tma) for config in (
    AttentionConfig(64, 32, 4, 3, pack_gqa=True), AttentionConfig(64, 32, 4, 2, pack_gqa=True),
    AttentionConfig(64, 64, 4, 3, pack_gqa=True), AttentionConfig(64, 32, 8, 3, pack_gqa=True),
    AttentionConfig(128, 32, 4, 3)) for tma in (False, True)]
SWEEP += [config for config in TMA_SWEEP if config.tma]
# Descriptor tiles by query-block size, key-tile size, warps, stages and a register cap: ``--sweep-set tiles`` (what
# chose CUDA_DEFAULT_CONFIG and CUDA_LONG_KEYS_CONFIG).
TILES_SWEEP = [AttentionConfig(block_m, block_n, warps, stages, pack_gqa=True, tma=True, maxnreg=maxnreg)
               for block_m, block_n, warps, stages, maxnreg in [
                   (64, 32, 8, 3, None), (32, 32, 4, 3, None), (32, 32, 4, 2, None), (32, 32, 4, 4, None),
                   (32, 64, 4, 2, None), (32, 64, 4, 3, None), (32, 64, 4, 3, 168), (64, 64, 8, 2, 128),
                   (64, 64, 8, 3, 128), (64, 64, 8, 2, None), (64, 64, 8, 3, None), (32, 128, 4, 2, None),
                   (64, 128, 8, 2, None), (32, 32, 8, 3, None), (16, 32, 4, 3, None)]]
SWEEP += [config for config in TILES_SWEEP if config not in SWEEP]
# Wider query blocks (128 tokens x 2 heads = 256 MMA rows, so each K/V tile serves twice the rows) with 8 or 16
# warps, against the two defaults: ``--sweep-set wide``.
WIDE_SWEEP = [AttentionConfig(block_m, block_n, warps, stages, pack_gqa=True, tma=True, maxnreg=maxnreg)
              for block_m, block_n, warps, stages, maxnreg in [
                  (64, 64, 8, 2, 128), (32, 32, 4, 2, None), (128, 64, 16, 2, None), (128, 64, 16, 3, None),
                  (128, 32, 16, 2, None), (128, 128, 16, 2, None), (128, 64, 8, 2, None), (64, 64, 4, 2, None),
                  (64, 128, 8, 2, 128), (64, 32, 4, 2, None)]]
SWEEP += [config for config in WIDE_SWEEP if config not in SWEEP]
# The two causal defaults alone: ``--sweep-only --sweep-set defaults`` times a kernel change on every pack.
# The long-keys default is the warp-specialized Gluon kernel on Hopper; its Triton tile is the reference next to it.
DEFAULTS_SWEEP = [CUDA_DEFAULT_CONFIG, CUDA_LONG_KEYS_CONFIG,
                  dataclasses.replace(CUDA_LONG_KEYS_CONFIG, warp_specialized=False)]
# Four query heads a kv head (the 4B/8B packs): the 32-token tile stacks 128 rows; 16 tokens give the 64 rows the
# 0.6B default has. ``--sweep-set gqa4``.
GQA4_SWEEP = [AttentionConfig(block_m, block_n, warps, stages, pack_gqa=True, tma=True)
              for block_m, block_n, warps, stages in [
                  (32, 32, 4, 2), (16, 32, 4, 2), (16, 32, 4, 3), (16, 64, 4, 2), (16, 16, 4, 2), (32, 32, 8, 2),
                  (32, 32, 8, 3), (32, 64, 8, 2), (32, 64, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (16, 32, 2, 2)]]
SWEEP_SETS = {"all": SWEEP, "tma": TMA_SWEEP, "tiles": TILES_SWEEP, "wide": WIDE_SWEEP, "defaults": DEFAULTS_SWEEP,
              "gqa4": GQA4_SWEEP}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def bench_backend(q, k, v, batch, backend) -> float:
    return do_bench(lambda: packed_attention(q, k, v, batch, backend=backend), warmup=25, rep=100)


def config_label(config: AttentionConfig) -> str:
    flags = (" tma" if config.tma else "") + (f" r{config.maxnreg}" if config.maxnreg else "") + \
        (" ws" if config.warp_specialized else "")
    return (f"{'gqa' if config.pack_gqa else 'head'} m{config.block_m:<3d} n{config.block_n:<3d} "
            f"w{config.num_warps} s{config.num_stages}{flags}")


def print_best(sweep: list[dict]) -> None:
    """One JSON line per pack: its fastest config, the fastest of each kind (packed or not), the default's time."""
    for workload in dict.fromkeys(row["workload"] for row in sweep):
        rows = [row for row in sweep if row["workload"] == workload]
        best = min(rows, key=lambda row: row["ms"])
        line = dict(kind="best", workload=workload, config=best["config"], ms=best["ms"], tflops=best["tflops"],
                    default_ms=rows[0]["default_ms"], speedup_vs_default=rows[0]["default_ms"] / best["ms"])
        for packed in (False, True):
            of_kind = [row for row in rows if row["config"]["pack_gqa"] == packed]
            if of_kind:
                fastest = min(of_kind, key=lambda row: row["ms"])
                line["best_packed" if packed else "best_unpacked"] = dict(config=fastest["config"],
                                                                          ms=fastest["ms"], tflops=fastest["tflops"])
        print(json.dumps(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out/attention.json"))
    parser.add_argument("--sweep", action="store_true", help="also time the Triton kernel over tile configs")
    parser.add_argument("--sweep-only", action="store_true",
                        help="time only the Triton sweep (implies --sweep), not the other backends")
    parser.add_argument("--sweep-set", choices=tuple(SWEEP_SETS), default="all",
                        help="the sweep's configs: all, or the tensor-descriptor ones next to their pointer twins")
    parser.add_argument("--workloads", nargs="+", metavar="SUBSTRING",
                        help="run only the packs whose name contains one of these (case-insensitive)")
    args = parser.parse_args()
    args.sweep = args.sweep or args.sweep_only
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "rows": [], "sweep": []}
    backends = [] if args.sweep_only else available_backends("cuda")
    for name, (layout, causal, (q_heads, kv_heads, head_dim)) in workloads().items():
        if args.workloads and not any(part.lower() in name.lower() for part in args.workloads):
            continue
        batch = make_batch(layout, causal)
        pairs = visible_pairs(batch)
        gflop = 4 * head_dim * q_heads * pairs / 1e9
        q = torch.randn(batch.num_tokens, q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch.num_tokens, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        start = time.perf_counter()
        build_block_mask(batch)
        torch.cuda.synchronize()
        mask_ms = (time.perf_counter() - start) * 1e3
        ours = packed_attention(q, k, v, batch, backend="triton")
        for backend in backends:
            if backend == "varlen" and batch.is_multi_item:
                continue
            if backend == "sdpa" and batch.max_seqlen > 4096:
                continue  # a boolean mask per long sequence sends SDPA to its math path: minutes
            diff = max_abs_diff(packed_attention(q, k, v, batch, backend=backend), ours)
            ms = bench_backend(q, k, v, batch, backend)
            results["rows"].append(dict(workload=name, backend=backend, tokens=batch.num_tokens, ms=ms,
                                        tflops=gflop / ms, max_abs_diff_vs_triton=diff,
                                        block_mask_build_ms=mask_ms if backend == "flex" else None))
        if args.sweep:
            default_ms = bench_backend(q, k, v, batch, "triton")
            for config in SWEEP_SETS[args.sweep_set]:
                def run_config(config=config):
                    return prefix_attention(q, k, v, batch.cu_seqlens, batch.max_seqlen, batch.prefix_lens,
                                            batch.span_starts, batch.causal, config=config)
                try:
                    diff = max_abs_diff(run_config(), ours)
                    ms = do_bench(run_config, warmup=25, rep=100)
                except Exception as error:  # a tile that does not fit (shared memory, registers) is a result too
                    print(json.dumps(dict(kind="sweep-failed", workload=name, config=dataclasses.asdict(config),
                                          error=str(error)[:200])), flush=True)
                    continue
                row = dict(workload=name, config=dataclasses.asdict(config), ms=ms, tflops=gflop / ms,
                           max_abs_diff_vs_default=diff, default_ms=default_ms)
                results["sweep"].append(row)
                print(json.dumps(dict(kind="sweep", **row)), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))

    print(f"device: {results['device']}, torch {results['torch']}; ms per layer, TFLOP/s over visible pairs")
    print(f"{'workload':42s} {'backend':8s} {'tokens':>7s} {'ms':>8s} {'TFLOP/s':>8s} {'max|diff|':>9s}")
    for row in results["rows"]:
        mask_note = f"  (block mask built in {row['block_mask_build_ms']:.1f} ms)" if row["backend"] == "flex" else ""
        print(f"{row['workload']:42s} {row['backend']:8s} {row['tokens']:7d} {row['ms']:8.3f} {row['tflops']:8.1f} "
              f"{row['max_abs_diff_vs_triton']:9.4f}{mask_note}")
    for row in results["sweep"]:
        print(f"sweep {row['workload'][:24]:24s} {config_label(AttentionConfig(**row['config']))} {row['ms']:7.3f} ms "
              f"{row['tflops']:6.1f} diff {row['max_abs_diff_vs_default']:.4f}")
    print_best(results["sweep"])


if __name__ == "__main__":
    main()
