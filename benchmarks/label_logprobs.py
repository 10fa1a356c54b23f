"""Label log-probabilities at the read positions: rerankit's kernels vs plain torch, bf16, Qwen3 vocabulary, GPU.

For each mode (full vocabulary, labels only with K=2), rows N and hidden size d: median time (triton do_bench)
and peak memory above the inputs, ours and torch's, with their ratios; full-vocab rows also give our TFLOP/s and
the rate at which we stream the lm_head. Prints JSON lines, then a table. --sweep instead times candidate tilings
of the full-vocabulary kernel, to tune `_vocab_tiling`.

    PYTHONPATH=src python benchmarks/label_logprobs.py [--sweep] [--out bench_out/label_logprobs.jsonl]
"""

import argparse
import json
from pathlib import Path

import torch
from triton.testing import do_bench

from rerankit.kernels.label_logprobs import _VocabTiling, _vocab_partial_logsumexp, label_logprobs

VOCAB = 151669  # Qwen3
ROWS = (1, 64, 1024, 16384)
DIMS = (1024, 2560, 4096)
LABELS = 2  # "yes" / "no"


def torch_full_logits(hidden, weight, label_ids, full_vocab):
    """What the model-card code does: [N, V] logits, float32 log-softmax (over the vocabulary or the labels)."""
    logits = hidden @ weight.T
    if full_vocab:
        return torch.log_softmax(logits, -1, dtype=torch.float32).gather(1, label_ids)
    return torch.log_softmax(logits.gather(1, label_ids), -1, dtype=torch.float32)


def torch_label_rows(hidden, weight, label_ids):
    """The careful torch labels-only version: gather the label rows of W first, never the full logits."""
    return torch.log_softmax(torch.einsum("nd,nkd->nk", hidden, weight[label_ids]), -1, dtype=torch.float32)


def measure(fn):
    """(median ms, peak bytes allocated above what was live before the call), or ('oom', None)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    live = torch.cuda.memory_allocated()
    try:
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - live
        return do_bench(fn, return_mode="median"), peak
    except torch.OutOfMemoryError:
        return "oom", None


def inputs(n_rows, dim):
    """Hidden states at the read positions and the same two label ids for every row, as a reranker reads them."""
    hidden = torch.randn(n_rows, dim, device="cuda", dtype=torch.bfloat16)
    label_ids = torch.tensor([[9693, 2152]], device="cuda").expand(n_rows, LABELS).contiguous()
    return hidden, label_ids


def ratio(a, b):
    """a / b, or None where either is missing ('oom', None, 0)."""
    return None if isinstance(a, str) or isinstance(b, str) or not b else a / b


def run_benchmark(emit):
    """Ours vs torch for every (d, N, mode); each record goes to `emit` and into the returned list."""
    records = []
    for dim in DIMS:
        weight = (torch.randn(VOCAB, dim, device="cuda") * 0.02).to(torch.bfloat16)
        for n_rows in ROWS:
            hidden, label_ids = inputs(n_rows, dim)
            for full_vocab in (True, False):
                ours_ms, ours_bytes = measure(lambda: label_logprobs(hidden, weight, label_ids, full_vocab=full_vocab))
                torch_ms, torch_bytes = measure(lambda: torch_full_logits(hidden, weight, label_ids, full_vocab))
                record = dict(
                    mode="full_vocab" if full_vocab else "labels_only", n_rows=n_rows, dim=dim, vocab=VOCAB,
                    ours_ms=ours_ms, torch_ms=torch_ms, speedup=ratio(torch_ms, ours_ms),
                    ours_mib=ours_bytes / 2**20, torch_mib=None if torch_bytes is None else torch_bytes / 2**20,
                    memory_ratio=ratio(ours_bytes, torch_bytes),
                )
                if full_vocab:
                    record["ours_tflops"] = 2 * n_rows * VOCAB * dim / ours_ms / 1e9
                    record["ours_weight_tbps"] = VOCAB * dim * 2 / ours_ms / 1e9
                else:
                    rows_ms, rows_bytes = measure(lambda: torch_label_rows(hidden, weight, label_ids))
                    rows_mib = None if rows_bytes is None else rows_bytes / 2**20
                    record.update(torch_rows_ms=rows_ms, torch_rows_mib=rows_mib)
                emit(record)
                records.append(record)
    return records


SWEEP = {
    1: [
        _VocabTiling(16, 128, 128, 4, 4, 4), _VocabTiling(16, 64, 128, 4, 4, 4), _VocabTiling(16, 64, 256, 4, 3, 4),
        _VocabTiling(16, 128, 64, 4, 4, 4), _VocabTiling(16, 128, 128, 4, 3, 8), _VocabTiling(16, 128, 128, 4, 4, 2),
        _VocabTiling(16, 256, 64, 4, 3, 4), _VocabTiling(16, 256, 128, 8, 3, 4), _VocabTiling(16, 64, 128, 4, 4, 8),
        _VocabTiling(16, 128, 128, 8, 4, 4), _VocabTiling(16, 32, 256, 4, 4, 8),
    ],
    64: [
        _VocabTiling(64, 128, 64, 4, 4, 4), _VocabTiling(64, 128, 64, 4, 3, 4), _VocabTiling(64, 128, 128, 4, 3, 4),
        _VocabTiling(64, 128, 128, 8, 3, 4), _VocabTiling(64, 64, 128, 4, 4, 4), _VocabTiling(64, 256, 64, 8, 3, 4),
        _VocabTiling(64, 128, 64, 4, 4, 8), _VocabTiling(64, 128, 64, 4, 4, 2), _VocabTiling(32, 128, 128, 4, 4, 4),
        _VocabTiling(16, 128, 128, 4, 4, 4), _VocabTiling(64, 64, 64, 4, 4, 8),
    ],
}
SWEEP[1024] = SWEEP[16384] = [
    _VocabTiling(128, 128, 64, 8, 3, 8), _VocabTiling(128, 128, 64, 8, 4, 8), _VocabTiling(128, 128, 64, 4, 3, 8),
    _VocabTiling(128, 256, 64, 8, 3, 8), _VocabTiling(128, 256, 64, 8, 3, 4), _VocabTiling(128, 128, 128, 8, 3, 8),
    _VocabTiling(64, 128, 64, 4, 3, 8), _VocabTiling(64, 256, 64, 8, 3, 8), _VocabTiling(128, 128, 64, 8, 3, 4),
    _VocabTiling(128, 128, 64, 8, 3, 16), _VocabTiling(256, 128, 64, 8, 3, 8),
]


def run_sweep(emit):
    """Time the full-vocabulary pass alone under each candidate tiling; print the fastest per shape."""
    fastest = {}
    for dim in (1024, 4096):
        weight = (torch.randn(VOCAB, dim, device="cuda") * 0.02).to(torch.bfloat16)
        for n_rows, tilings in SWEEP.items():
            hidden = torch.randn(n_rows, dim, device="cuda", dtype=torch.bfloat16)
            for tiling in tilings:
                try:
                    ms = do_bench(lambda: _vocab_partial_logsumexp(hidden, weight, None, tiling), return_mode="median")
                except Exception as error:  # a tiling may not fit in shared memory or registers: note it, go on
                    ms = f"failed: {type(error).__name__}"
                emit(dict(sweep=True, n_rows=n_rows, dim=dim, tiling=tiling._asdict(), ms=ms))
                if not isinstance(ms, str) and ms < fastest.get((n_rows, dim), (float("inf"),))[0]:
                    fastest[n_rows, dim] = (ms, tiling)
    print(f"\nfastest tilings on {torch.cuda.get_device_name()}:")
    for (n_rows, dim), (ms, tiling) in fastest.items():
        print(f"N={n_rows:>6} d={dim:>5}  {ms:8.3f} ms  {tiling}")


def fmt(value, spec):
    return value if isinstance(value, str) else "-" if value is None else format(value, spec)


def print_table(records):
    print(f"\ndevice: {torch.cuda.get_device_name()}  V={VOCAB} bf16, K={LABELS}; memory = peak above the inputs")
    head = ("mode", "N", "d", "ours ms", "torch ms", "speedup", "ours MiB", "torch MiB", "ours/torch mem %", "rows ms")
    print("{:<12}{:>6}{:>6}{:>10}{:>10}{:>9}{:>11}{:>11}{:>18}{:>9}".format(*head))
    for r in records:
        print("{:<12}{:>6}{:>6}{:>10}{:>10}{:>9}{:>11}{:>11}{:>18}{:>9}".format(
            r["mode"], r["n_rows"], r["dim"], fmt(r["ours_ms"], ".3f"), fmt(r["torch_ms"], ".3f"),
            fmt(r["speedup"], ".2f"), fmt(r["ours_mib"], ".2f"), fmt(r["torch_mib"], ".1f"),
            fmt(r["memory_ratio"] and 100 * r["memory_ratio"], ".4f"), fmt(r.get("torch_rows_ms"), ".3f"),
        ))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the JSON lines here")
    parser.add_argument("--sweep", action="store_true", help="time candidate tilings of the vocab kernel instead")
    args = parser.parse_args()
    lines = []

    def emit(record):
        line = json.dumps(record)
        print(line, flush=True)
        lines.append(line)

    if args.sweep:
        run_sweep(emit)
    else:
        records = run_benchmark(emit)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    if not args.sweep:
        print_table(records)


if __name__ == "__main__":
    main()
