"""Pair-scoring throughput and latency: rerankit's embedded engine vs transformers, side by side in one run.

Workloads (DESIGN.md section 8), random weights in the real shapes, the Qwen3-Reranker template:
  W1  1 query x 100 docs, doc lengths uniform in [64, 448) tokens       (Qwen3-Reranker-0.6B shape)
  W2  64 queries x 100 docs (throughput), one ``score_batch`` call       (0.6B)
  W3  1 query x 20 docs, p50/p99 latency                                 (0.6B)
  LI  long instruction: a ~1,024-token prefix, 100 items of 128 tokens  (the MIS workload of issue 4)
  W4  W1 on the 4B and 8B shapes, and a BERT-large cross-encoder          (--w4)
Ours runs with multi-item scoring (MIS, the default) and without (``multi_item=False``, packed pairs). Baselines:
transformers as the Qwen3-Reranker model card does it (left-padded batch, logits at every position) and the same
with ``logits_to_keep=1``. They score query by query, so on W2 they run the first ``--baseline-queries`` queries
and their rate on those is their W2 rate.

body_mfu counts the matmul FLOPs of the tokens a variant must compute at the least (no padding; MIS: the prefix
once per micro-batch) against the H100's dense bf16 peak. peak_gib is the memory a call allocates above what was
resident (both models' weights). ``--budgets`` times ours at several micro-batch budgets; ``--profile`` writes, for
one W1 and one W3 call, the host time of each engine phase, GPU time by kernel kind and a torch.profiler table.

    PYTHONPATH=src python benchmarks/pairs.py --out results.json --profile profiles/ --budgets 8192,16384,32768

``--dtype fp8`` adds rows of the FP8 engine (``rerankit-fp8-*``) beside the bf16 ones and the transformers baselines
of the same run, and a fidelity check per shape: the first 48 docs of W1 scored by transformers in float32 (the
reference), transformers bf16 keep-1, rerankit bf16 and rerankit FP8, each row with its largest |score - fp32| and
|score - bf16| and Spearman against both (``fidelity.py``); with ``--w4-shapes bert-large`` the cross-encoder's FP8
row and its fidelity (100 docs against transformers in float32), and on every FP8 run the packaged MiniLM's real
weights in float32, bf16 and FP8 (``minilm_fidelity``). ``--tiny`` runs W1 (8 docs) on a 2-layer model on the
CPU (FP8 in reference mode, $RERANKIT_FP8_REFERENCE=1), to check the script itself:

    PYTHONPATH=src python benchmarks/pairs.py --tiny --dtype fp8

Prints one JSON object per measurement, then a table.

H100 80GB, torch 2.11, transformers 5.17, budget 32k (bench_out/pairs_h100.json): pairs/s MIS / packed / keep-1 /
model card: W1 1,467 / 1,165 / 274 / 184; W2 1,330 / 1,114 / 290 / 198; LI 1,814 / 334 / 127 / 89; W3 p50 24.6 /
29.7 / 87.4 / 122.1 ms. Peak above resident <= 1.27 GiB (ours), 15.8-34.8 GiB (model card on W1/W2/LI).
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
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fidelity import FIDELITY_DOCS, fidelity_rows, minilm_fidelity  # noqa: E402
from tiny_models import build_decoder_tokenizer  # noqa: E402  (the small BPE tokenizer with chat tokens)

from rerankit.engine import EmbeddedBackend  # noqa: E402
from rerankit.schema import ScoreRequest  # noqa: E402
from rerankit.templates import get_template  # noqa: E402

PEAK_BF16_FLOPS = 989e12  # H100 SXM dense bf16, datasheet; MFU is quoted against it
SHAPES = {
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, tie_word_embeddings=True),
    "4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, intermediate_size=9728, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, intermediate_size=12288, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, tie_word_embeddings=True),  # --tiny: the script on a CPU
}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 151669
QUERY = "what is the capital of france and why is it famous"


@dataclass
class Workload:
    name: str
    queries: list[str]
    docs: list[list[str]]  # per query
    instruction: str | None = None
    latency: bool = False
    repeats: int = 3


def single_token_words(tokenizer) -> list[str]:
    """Words that the tokenizer keeps as one token after a space, so a doc of n words is n tokens."""
    words = []
    for token in tokenizer.get_vocab():
        word = tokenizer.convert_tokens_to_string([token]).strip()
        if word.isalpha() and len(tokenizer(" " + word, add_special_tokens=False)["input_ids"]) == 1:
            words.append(word)
    return sorted(set(words))


def make_docs(words: list[str], count: int, low: int, high: int, rng: random.Random) -> list[str]:
    return [" ".join(rng.choice(words) for _ in range(rng.randrange(low, high))) for _ in range(count)]


def build_decoder_dir(root: Path, shape: str) -> Path:
    """A Qwen3ForCausalLM of the given shape with random bf16 weights, saved with the small tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = root / f"qwen3-reranker-{shape}-random"
    tokenizer = build_decoder_tokenizer(folder)
    config = Qwen3Config(vocab_size=VOCAB, max_position_embeddings=40960, rope_theta=1000000.0,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    empty_cache()
    return folder


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def body_flops(config, tokens: int, attended: int) -> float:
    """Matmul FLOPs of the transformer body (no lm_head): ``tokens`` rows through the linear layers, and
    ``attended`` (query, key) pairs through QK and PV."""
    d, layers = config.hidden_size, config.num_hidden_layers
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_token = 2 * layers * (d * (heads + 2 * kv) * hd + heads * hd * d + 3 * d * config.intermediate_size)
    return per_token * tokens + 4 * layers * heads * hd * attended


def causal_pairs(length: int) -> int:
    return length * (length + 1) // 2


def attended_pairs(prefix: int, spans: list[int], shared: bool) -> int:
    """(query, key) pairs that one request's items attend, the prefix computed once (MIS) or once per item."""
    if shared:
        return causal_pairs(prefix) + sum(span * prefix + causal_pairs(span) for span in spans)
    return sum(causal_pairs(prefix + span) for span in spans)


def time_call(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def measure(fn, repeats: int, warmups: int) -> tuple[list[float], float]:
    """Warm up, then time; also the peak memory the calls allocate above what was resident."""
    for _ in range(warmups):
        fn()
    if DEVICE != "cuda":
        return time_call(fn, repeats), 0.0
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = time_call(fn, repeats)
    return times, (torch.cuda.max_memory_allocated() - resident) / 2**30


def model_card_scores(model, tokenizer, query: str, docs: list[str], instruction: str | None, keep_one: bool,
                      batch_size: int = 100) -> torch.Tensor:
    """The model card's way: whole prompts, left-padded batch, logits at the last position, softmax over no/yes."""
    template = get_template("qwen3-reranker")
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    prompts = [template.prefix(instruction, query) + template.item(doc) + template.suffix(instruction) for doc in docs]
    scores = []
    for start in range(0, len(prompts), batch_size):
        inputs = tokenizer(prompts[start:start + batch_size], padding=True, return_tensors="pt",
                           add_special_tokens=False).to(model.device)
        extra = {"logits_to_keep": 1} if keep_one else {}
        logits = model(**inputs, use_cache=False, **extra).logits[:, -1, :]
        pair = torch.stack([logits[:, no], logits[:, yes]], dim=1).float().log_softmax(dim=1)
        scores.append(pair[:, 1].exp())
    return torch.cat(scores)


def requests_of(workload: Workload, multi_item: bool, queries: int | None = None) -> list[ScoreRequest]:
    return [ScoreRequest(query=q, items=docs, instruction=workload.instruction, template="qwen3-reranker",
                         multi_item=multi_item) for q, docs in list(zip(workload.queries, workload.docs))[:queries]]


def encoded_layout(backend: EmbeddedBackend, requests: list[ScoreRequest]) -> list[tuple[int, list[int]]]:
    """(prefix length, span lengths) of each request as the engine encodes it."""
    loaded = backend._model()
    layouts = []
    for position, request in enumerate(requests):
        encoded = backend._prepare(request, loaded, position).encoded
        layouts.append((len(encoded.prefix_ids), [len(item) + len(encoded.suffix_ids) for item in encoded.item_ids]))
    return layouts


def row_for(workload: Workload, variant: str, times: list[float], peak: float, pairs: int, tokens: int,
            flops: float) -> dict:
    median = statistics.median(times)
    row = {"workload": workload.name, "variant": variant, "pairs": pairs, "tokens": tokens,
           "pairs_per_s": pairs / median, "tokens_per_s": tokens / median,
           "body_mfu": flops / median / PEAK_BF16_FLOPS, "peak_gib": peak, "median_s": median}
    if not workload.latency:  # every call, in order: a host's hiccups show here, not only in the median
        row["call_ms"] = [round(1000 * t, 2) for t in times]
    if workload.latency:
        ordered = sorted(times)
        row["p50_ms"] = 1000 * statistics.median(ordered)
        row["p99_ms"] = 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return row


def run_workload(workload: Workload, model, tokenizer, backend: EmbeddedBackend, baseline_queries: int,
                 results: list[dict], label: str = "rerankit", baselines: bool = True) -> None:
    """Rows of ``backend``'s variants (named ``label``-mis, ...) and, with ``baselines``, transformers'; then a
    check row: score differences and speed ratios."""
    layouts = encoded_layout(backend, requests_of(workload, False))
    pair_lengths = [prefix + span for prefix, spans in layouts for span in spans]
    rows = []
    overlap, prefix_cache = backend._overlap, backend._runner.prefix_cache
    variants = [(f"{label}-mis", True, overlap, True), (f"{label}-packed", False, overlap, True),
                (f"{label}-mis-overlap", True, True, True)]
    if workload.instruction is not None:  # a long head: kept across calls (the default) and computed each call
        variants.append((f"{label}-mis-heads-computed", True, overlap, False))
    for variant, multi_item, overlapped, keep_heads in variants:
        backend._overlap = overlapped  # overlap: planning thread + ramp-up chunk (EmbeddedBackend's overlap=True)
        backend._runner.prefix_cache = prefix_cache if keep_heads else None
        batch = requests_of(workload, multi_item)
        tokens = sum(response.usage.computed_tokens for response in backend.score_batch(batch))
        attended = sum(attended_pairs(prefix, spans, multi_item) for prefix, spans in layouts)
        times, peak = measure(lambda: backend.score_batch(batch), workload.repeats, 1 if len(batch) > 1 else 2)
        rows.append(row_for(workload, variant, times, peak, len(pair_lengths), tokens,
                            body_flops(model.config, tokens, attended)))
    backend._overlap, backend._runner.prefix_cache = overlap, prefix_cache
    queries = min(len(workload.queries), baseline_queries)
    baseline_pairs = sum(len(docs) for docs in workload.docs[:queries])
    baseline_lengths = pair_lengths[:baseline_pairs]
    baseline_flops = body_flops(model.config, sum(baseline_lengths), sum(map(causal_pairs, baseline_lengths)))
    for variant, keep_one in (("transformers-keep1", True), ("transformers-modelcard", False))[:2 if baselines else 0]:
        def baseline():
            return [model_card_scores(model, tokenizer, q, docs, workload.instruction, keep_one)
                    for q, docs in zip(workload.queries[:queries], workload.docs[:queries])]

        try:
            times, peak = measure(baseline, workload.repeats if queries == 1 else 1, 1)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            rows.append({"workload": workload.name, "variant": variant, "error": "oom"})
            continue
        rows.append(row_for(workload, variant, times, peak, baseline_pairs, sum(baseline_lengths), baseline_flops))
    for row in rows:
        results.append(row)
        print(json.dumps(row), flush=True)
    first = requests_of(workload, True, 1)[0]
    shared = torch.tensor(backend.score(first).scores)
    packed = torch.tensor(backend.score(first.model_copy(update={"multi_item": False})).scores)
    card = model_card_scores(model, tokenizer, first.query, list(first.items), workload.instruction, True).float()
    rate = {row["variant"]: row["pairs_per_s"] for row in results + rows if "pairs_per_s" in row
            and row.get("workload") == workload.name and "budget" not in row}
    check = {"workload": workload.name, "check": f"scores {label}",
             "max_abs_diff_packed_vs_keep1": float((packed - card.cpu()).abs().max()),
             "max_abs_diff_mis_vs_packed": float((shared - packed).abs().max())}
    for name in (f"{label}-packed", f"{label}-mis-overlap", "rerankit-mis", "transformers-keep1",
                 "transformers-modelcard"):
        if name in rate and name != f"{label}-mis":
            check[f"mis_over_{name.replace('-', '_')}"] = rate[f"{label}-mis"] / rate[name]
    results.append(check)
    print(json.dumps(check), flush=True)


def decoder_workloads(words: list[str], rng: random.Random, include: set[str], w1_docs: int = 100) -> list[Workload]:
    out = []
    if "W1" in include:
        out.append(Workload("W1", [QUERY], [make_docs(words, w1_docs, 64, 448, rng)], repeats=15))
    if "W2" in include:
        out.append(Workload("W2", [f"{QUERY} {i}" for i in range(64)],
                            [make_docs(words, 100, 64, 448, rng) for _ in range(64)], repeats=2))
    if "W3" in include:
        out.append(Workload("W3", [QUERY], [make_docs(words, 20, 64, 448, rng)], latency=True, repeats=50))
    if "LI" in include:
        instruction = " ".join(rng.choice(words) for _ in range(1000))
        out.append(Workload("LI", [QUERY], [make_docs(words, 100, 128, 129, rng)], instruction, repeats=15))
    return out


def reference_scores(folder: Path, tokenizer, query: str, docs: list[str]) -> torch.Tensor:
    """The fidelity reference: transformers in float32 (keep-1), loaded alone (the 8B shape takes 32 GB)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(DEVICE).eval()
    with torch.inference_mode():
        scores = model_card_scores(model, tokenizer, query, docs, None, True, batch_size=8).float().cpu()
    del model
    empty_cache()
    return scores


def weights_gib(backend: EmbeddedBackend) -> float:
    """GiB of the tensors the backend holds: the transformers model's and the packed model's, each counted once."""
    loaded, runner = backend._model(), backend._runner
    tensors = list(loaded.model.parameters())
    packed = getattr(runner, "model", None)
    if isinstance(packed, torch.nn.Module):
        tensors += list(packed.parameters()) + list(packed.buffers())
    unique = {t.data_ptr(): t for t in tensors if t.numel()}
    return sum(t.numel() * t.element_size() for t in unique.values()) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W1,W2,W3,LI")
    parser.add_argument("--w4", action="store_true", help="also the 4B/8B shapes and the BERT-large cross-encoder")
    parser.add_argument("--w4-shapes", default="4b,8b,bert-large", help="which W4 models --w4 runs")
    parser.add_argument("--w4-docs", type=int, default=100, help="docs of the W4 shapes' W1 query")
    parser.add_argument("--baseline-queries", type=int, default=8, help="W2 queries the baselines run")
    parser.add_argument("--budgets", default="", help="micro-batch budgets to sweep on W1, W2 and LI, e.g. 8192,32768")
    parser.add_argument("--sweep-queries", type=int, default=16, help="W2 queries in the budget sweep")
    parser.add_argument("--profile", default=None, help="folder for profiles of one W1, W3 and LI call")
    parser.add_argument("--ab", action="store_true", help="W1/W3 with the fused q/k kernel and attention tilings")
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16",
                        help="fp8: also the FP8 engine's rows, and the fidelity check against float32")
    parser.add_argument("--fp8-projections", default="",
                        help="with --dtype fp8: ';'-separated FP8 variants, each the projections it quantizes, "
                             "'/unfused' for o/down's quantization pass and add apart (e.g. ';/unfused;qkv,gate_up'; "
                             "empty: all four, fused)")
    parser.add_argument("--tiny", action="store_true", help="W1 (8 docs) on a 2-layer model: runs on a CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.dtype == "fp8" and DEVICE != "cuda":
        os.environ.setdefault("RERANKIT_FP8_REFERENCE", "1")  # FP8's numerics in torch (engine.fp8)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    results: list[dict] = [{"device": name, "torch": torch.__version__}]
    print(json.dumps(results[0]), flush=True)
    root = Path(tempfile.mkdtemp(prefix="rerankit-bench-"))
    include = set(args.workloads.split(","))
    w4 = set(args.w4_shapes.split(",")) if args.w4 else set()
    shapes = ([("0.6b", include)] if include - {""} else []) + [(shape, {"W1"}) for shape in ("4b", "8b") if shape in w4]
    if args.tiny:
        shapes, w4 = [("tiny", {"W1"})], set()
    # (dtype, the projections FP8 quantizes: None for all four)
    dtypes = [("bfloat16", None)] + ([("fp8", names or None) for names in args.fp8_projections.split(";")]
                                     if args.dtype == "fp8" else [])
    for shape, shape_workloads in shapes:
        folder = build_decoder_dir(root, shape)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.padding_side = "left"
        words = single_token_words(tokenizer)
        workloads = decoder_workloads(words, random.Random(0), shape_workloads,
                                      8 if args.tiny else args.w4_docs if shape != "0.6b" else 100)
        if args.tiny:
            workloads[0].repeats = 2
        fidelity_docs = make_docs(words, FIDELITY_DOCS if not args.tiny else 8, 64, 448, random.Random(1))
        fp32 = reference_scores(folder, tokenizer, QUERY, fidelity_docs) if args.dtype == "fp8" else None
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(DEVICE).eval()
        baseline_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        fidelity: dict[str, torch.Tensor] = {}
        for dtype, variant in dtypes:
            projections = variant or ""
            label = "rerankit" if dtype == "bfloat16" else "rerankit-fp8"
            if variant:
                label += "-" + variant.replace(",", "+")
            os.environ["RERANKIT_FP8_PROJECTIONS"] = projections  # engine.fp8.projections; empty: the defaults
            begun = time.perf_counter()
            backend = EmbeddedBackend(str(folder), device=DEVICE, dtype=dtype)
            weights = weights_gib(backend)
            results.append({"shape": shape, "dtype": label, "runner": backend.runner, "weights_gib": weights,
                            "max_batch_tokens": backend.max_batch_tokens, "load_s": time.perf_counter() - begun})
            print(json.dumps(results[-1]), flush=True)
            with torch.inference_mode():
                begun = time.perf_counter()
                backend.score_batch(requests_of(workloads[0], True) + requests_of(workloads[0], False))
                results.append({"shape": shape, "dtype": label, "first_call_s (compile)": time.perf_counter() - begun})
                for workload in workloads:
                    if shape != "0.6b":
                        workload.name = f"W4-{shape}"
                    run_workload(workload, model, tokenizer, backend, args.baseline_queries, results, label,
                                 baselines=dtype == "bfloat16")
                # What stays allocated between calls beyond the weights (ours and the baselines' model): the CUDA
                # graph pool (captured before the timed calls, so the rows' peaks miss it), heads, caches.
                graphs = backend._runner.graphs
                allocated = torch.cuda.memory_allocated() / 2**30 if DEVICE == "cuda" else float("nan")
                results.append({"shape": shape, "dtype": label, "graphs_captured": graphs.captures if graphs else 0,
                                "resident_above_weights_gib": allocated - weights - baseline_gib})
                print(json.dumps(results[-1]), flush=True)
                if fp32 is not None:
                    for multi_item, kind in ((True, "mis"), (False, "packed")):
                        scored = backend.score(ScoreRequest(query=QUERY, items=fidelity_docs, multi_item=multi_item,
                                                            template="qwen3-reranker"))
                        fidelity[f"{label}-{kind}"] = torch.tensor(scored.scores)
                if args.profile and (dtype == "fp8" or shape != "0.6b"):  # 0.6B bf16: W1, W3, LI below
                    from pairs_extras import profile_call

                    profile_call(workloads[0], backend, Path(args.profile), results, tag=f"-{shape}-{label}")
                if shape == "0.6b" and dtype == "bfloat16" and (args.budgets or args.ab or args.profile):
                    from pairs_extras import bf16_extras  # imports this module: only when asked

                    bf16_extras(args, workloads, backend, results)
            backend.close()
            empty_cache()
        if fp32 is not None:
            with torch.inference_mode():
                fidelity["transformers-bf16-keep1"] = model_card_scores(model, tokenizer, QUERY, fidelity_docs, None,
                                                                        True)
            for row in fidelity_rows(workloads[0].name, fidelity, fp32, "rerankit-packed"):
                results.append(row)
                print(json.dumps(row), flush=True)
        del model
        empty_cache()
    if "bert-large" in w4:
        with torch.inference_mode():
            from bert_large import bert_large_workload

            bert_large_workload(root, results, 5, fp8=args.dtype == "fp8")
    if args.dtype == "fp8" and (args.w4 or include - {""}):
        with torch.inference_mode():
            minilm_fidelity(results, QUERY, DEVICE)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print_table(results)


def print_table(results: list[dict]) -> None:
    print(f"\n{results[0]['device']}")
    print(f"{'workload':<14}{'variant':<24}{'budget':>7}{'pairs/s':>9}{'tok/s':>10}{'MFU':>7}{'peakGiB':>8}"
          f"{'p50ms':>7}{'p99ms':>7}")
    for row in results[1:]:
        if "check" in row:
            what = f"{row['check']} {row.get('variant', '')}".strip()
            print(f"{row['workload']:<14}{what}: " + ", ".join(
                f"{k}={v}" if isinstance(v, bool) else f"{k}={v:.3g}" for k, v in row.items()
                if isinstance(v, (float, bool))))
        elif "error" in row:
            print(f"{row['workload']:<14}{row['variant']:<24}{row['error']:>16}")
        elif "variant" in row:
            print(f"{row['workload']:<14}{row['variant']:<24}{row.get('budget', ''):>7}{row['pairs_per_s']:>9.0f}"
                  f"{row.get('tokens_per_s', 0):>10.0f}{row.get('body_mfu', 0):>7.1%}{row['peak_gib']:>8.2f}"
                  f"{row.get('p50_ms', float('nan')):>7.1f}{row.get('p99_ms', float('nan')):>7.1f}")
        else:
            print(json.dumps(row))


if __name__ == "__main__":
    main()
