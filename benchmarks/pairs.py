"""Pair-scoring throughput and latency: rerankit's embedded engine vs transformers, side by side in one run.

Workloads (DESIGN.md section 8), random weights in the real shapes, the Qwen3-Reranker template:
  W1  1 query x 100 docs, doc lengths uniform in [64, 448) tokens       (Qwen3-Reranker-0.6B shape)
  W2  64 queries x 100 docs (throughput)                                 (0.6B)
  W3  1 query x 20 docs, p50/p99 latency                                 (0.6B)
  W4  W1 on the 4B and 8B shapes, and a BERT-large cross-encoder          (--w4)
  LI  long instruction: a 1,024-token prefix, 100 items of 128 tokens     (MIS workload of issue 4)
Baselines: transformers as the Qwen3-Reranker model card does it (left-padded batch, full logits at every
position) and the same with ``logits_to_keep=1``. Ours runs with multi-item scoring on and off.

Run on a GPU:  PYTHONPATH=src python benchmarks/pairs.py [--w4] [--out results.json]
Prints one JSON object per measurement, then a table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import build_decoder_tokenizer  # noqa: E402  (the small BPE tokenizer with chat tokens)

from rerankit.engine import EmbeddedBackend  # noqa: E402
from rerankit.schema import ScoreRequest  # noqa: E402

PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16, datasheet; MFU is quoted against it
SHAPES = {
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, tie_word_embeddings=True),
    "4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, intermediate_size=9728, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, intermediate_size=12288, tie_word_embeddings=False),
}
VOCAB = 151669


@dataclass
class Workload:
    name: str
    queries: list[str]
    docs: list[list[str]]  # per query
    instruction: str | None = None


def single_token_words(tokenizer) -> list[str]:
    """Words that the tokenizer keeps as one token after a space, so a doc of n words is n tokens."""
    words = []
    for token, _ in tokenizer.get_vocab().items():
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
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def body_flops(config, lengths: list[int], prefix_shared: bool = False) -> float:
    """Matmul FLOPs of the transformer body for sequences of these lengths (no lm_head), causal attention."""
    d, layers = config.hidden_size, config.num_hidden_layers
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_token = 2 * layers * (d * (heads + 2 * kv) * hd + heads * hd * d + 3 * d * config.intermediate_size)
    attention = sum(2 * layers * heads * hd * n * n for n in lengths)  # QK and PV, causal half of 4*n^2
    return per_token * sum(lengths) + attention


def time_call(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def measure(fn, repeats: int) -> tuple[list[float], float]:
    """Warm up twice, then time; also the peak memory the calls allocate above what was resident."""
    fn()
    fn()
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = time_call(fn, repeats)
    return times, (torch.cuda.max_memory_allocated() - resident) / 2**30


def model_card_scores(model, tokenizer, backend: EmbeddedBackend, query: str, docs: list[str],
                      instruction: str | None, keep_one: bool, batch_size: int = 100) -> torch.Tensor:
    """The model card's way: whole prompts, left-padded batch, logits at the last position, softmax over no/yes."""
    from rerankit.templates import get_template

    template = get_template("qwen3-reranker")
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    prompts = [template.prefix(instruction, query) + template.item(doc) + template.suffix(instruction) for doc in docs]
    scores = []
    for start in range(0, len(prompts), batch_size):
        inputs = tokenizer(prompts[start:start + batch_size], padding=True, return_tensors="pt",
                           add_special_tokens=False).to("cuda")
        extra = {"logits_to_keep": 1} if keep_one else {}
        logits = model(**inputs, use_cache=False, **extra).logits[:, -1, :]
        pair = torch.stack([logits[:, no], logits[:, yes]], dim=1).float().log_softmax(dim=1)
        scores.append(pair[:, 1].exp())
    return torch.cat(scores)


def run_workload(workload: Workload, model, tokenizer, backend: EmbeddedBackend, config, repeats: int,
                 results: list[dict], latency: bool = False) -> None:
    pairs = sum(len(docs) for docs in workload.docs)
    requests = [ScoreRequest(query=q, items=docs, instruction=workload.instruction, template="qwen3-reranker")
                for q, docs in zip(workload.queries, workload.docs)]
    reference = backend.score(requests[0].model_copy(update={"multi_item": False}))
    pair_lengths = _pair_lengths(backend, requests)
    tokens = sum(pair_lengths)

    def ours(multi_item: bool):
        batch = [r.model_copy(update={"multi_item": multi_item}) for r in requests]
        score_batch = getattr(backend, "score_batch", None)
        return (lambda: score_batch(batch)) if score_batch else (lambda: [backend.score(r) for r in batch])

    def baseline(keep_one: bool):
        return lambda: [model_card_scores(model, tokenizer, backend, q, docs, workload.instruction, keep_one)
                        for q, docs in zip(workload.queries, workload.docs)]

    variants = {"rerankit-mis": ours(True), "rerankit-packed": ours(False),
                "transformers-keep1": baseline(True), "transformers-modelcard": baseline(False)}
    ours_scores = torch.tensor(reference.scores)
    card = model_card_scores(model, tokenizer, backend, workload.queries[0], workload.docs[0], workload.instruction,
                             True).float().cpu()
    mis_scores = torch.tensor(backend.score(requests[0]).scores)
    for name, fn in variants.items():
        try:
            times, peak = measure(fn, repeats)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            results.append({"workload": workload.name, "variant": name, "error": "oom"})
            continue
        median = statistics.median(times)
        row = {"workload": workload.name, "variant": name, "pairs": pairs, "tokens": tokens,
               "pairs_per_s": pairs / median, "tokens_per_s": tokens / median,
               "body_mfu": body_flops(config, pair_lengths) / median / PEAK_BF16_FLOPS,
               "peak_gib_above_resident": peak, "median_s": median}
        if latency:
            ordered = sorted(times)
            row["p50_ms"] = 1000 * ordered[len(ordered) // 2]
            row["p99_ms"] = 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        results.append(row)
        print(json.dumps(row), flush=True)
    check = {"workload": workload.name, "check": "scores",
             "max_abs_diff_packed_vs_modelcard": float((ours_scores - card).abs().max()),
             "max_abs_diff_mis_vs_packed": float((mis_scores - ours_scores).abs().max())}
    results.append(check)
    print(json.dumps(check), flush=True)


def _pair_lengths(backend: EmbeddedBackend, requests: list[ScoreRequest]) -> list[int]:
    from rerankit.engine.encode import encode_request, resolve_template

    loaded = backend._model()
    lengths = []
    for request in requests:
        template = resolve_template(request, loaded, None, "generative")
        lengths += encode_request(request, loaded, "generative", template).pair_lengths
    return lengths


def decoder_workloads(words: list[str], rng: random.Random, include: set[str]) -> list[tuple[Workload, bool, int]]:
    query = "what is the capital of france and why is it famous"
    out = []
    if "W1" in include:
        out.append((Workload("W1", [query], [make_docs(words, 100, 64, 448, rng)]), False, 5))
    if "W2" in include:
        out.append((Workload("W2", [f"{query} {i}" for i in range(64)],
                             [make_docs(words, 100, 64, 448, rng) for _ in range(64)]), False, 2))
    if "W3" in include:
        out.append((Workload("W3", [query], [make_docs(words, 20, 64, 448, rng)]), True, 50))
    if "LI" in include:
        instruction = " ".join(rng.choice(words) for _ in range(1000))
        out.append((Workload("LI", [query], [make_docs(words, 100, 128, 129, rng)], instruction), False, 5))
    return out


def bert_large_workload(root: Path, results: list[dict], repeats: int) -> None:
    """W4 cross-encoder: a BERT-large-shaped BertForSequenceClassification, 1 query x 100 docs."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import _copy_wordpiece_tokenizer

    folder = root / "bert-large-ce-random"
    folder.mkdir(parents=True, exist_ok=True)
    config = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                        num_labels=1, max_position_embeddings=512)
    with torch.device("cuda"):
        model = BertForSequenceClassification(config).to(torch.bfloat16).eval()
    model.save_pretrained(folder)
    _copy_wordpiece_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rng = random.Random(1)
    vocab_words = [w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 2][:5000]
    docs = [" ".join(rng.choice(vocab_words) for _ in range(rng.randrange(64, 448))) for _ in range(100)]
    query = "what is the capital of france"
    backend = EmbeddedBackend(str(folder), device="cuda", dtype="bfloat16")
    request = ScoreRequest(query=query, items=docs, max_tokens_per_item=448)

    def baseline():
        inputs = tokenizer([query] * len(docs), docs, padding=True, truncation=True, max_length=512,
                           return_tensors="pt").to("cuda")
        return model(**inputs).logits

    for name, fn in {"rerankit": lambda: backend.score(request), "transformers-padded": baseline}.items():
        times, peak = measure(fn, repeats)
        median = statistics.median(times)
        row = {"workload": "W4-bert-large", "variant": name, "pairs": 100, "pairs_per_s": 100 / median,
               "peak_gib_above_resident": peak, "median_s": median}
        results.append(row)
        print(json.dumps(row), flush=True)
    backend.close()
    del model
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W1,W2,W3,LI")
    parser.add_argument("--w4", action="store_true", help="also the 4B/8B shapes and the BERT-large cross-encoder")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    results: list[dict] = [{"device": torch.cuda.get_device_name(), "torch": torch.__version__}]
    print(json.dumps(results[0]), flush=True)
    root = Path(tempfile.mkdtemp(prefix="rerankit-bench-"))
    include = set(args.workloads.split(","))
    shapes = [("0.6b", include)] + ([("4b", {"W1"}), ("8b", {"W1"})] if args.w4 else [])
    for shape, shape_workloads in shapes:
        folder = build_decoder_dir(root, shape)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
        backend = EmbeddedBackend(str(folder), device="cuda", dtype="bfloat16")
        words = single_token_words(tokenizer)
        rng = random.Random(0)
        with torch.inference_mode():
            for workload, latency, repeats in decoder_workloads(words, rng, shape_workloads):
                if shape != "0.6b":
                    workload.name = f"W4-{shape}"
                run_workload(workload, model, tokenizer, backend, model.config, repeats, results, latency)
        backend.close()
        del model
        torch.cuda.empty_cache()
    if args.w4:
        with torch.inference_mode():
            bert_large_workload(root, results, 5)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print_table(results)


def print_table(results: list[dict]) -> None:
    print(f"\n{results[0]['device']}")
    print(f"{'workload':<16}{'variant':<24}{'pairs/s':>10}{'tok/s':>12}{'MFU':>7}{'peakGiB':>9}{'p50ms':>8}{'p99ms':>8}")
    for row in results[1:]:
        if "variant" not in row:
            print(f"{row['workload']:<16}check: " + ", ".join(f"{k}={v:.2e}" for k, v in row.items()
                                                            if isinstance(v, float)))
            continue
        if "error" in row:
            print(f"{row['workload']:<16}{row['variant']:<24}{row['error']:>10}")
            continue
        print(f"{row['workload']:<16}{row['variant']:<24}{row['pairs_per_s']:>10.0f}{row.get('tokens_per_s', 0):>12.0f}"
              f"{row.get('body_mfu', 0):>7.1%}{row['peak_gib_above_resident']:>9.2f}"
              f"{row.get('p50_ms', float('nan')):>8.1f}{row.get('p99_ms', float('nan')):>8.1f}")


if __name__ == "__main__":
    main()
