"""W4's cross-encoder for ``pairs.py --w4 --w4-shapes bert-large`` and ``encoder_fp8_calls.py``: a BERT-large-shaped
BertForSequenceClassification with random weights, its 100 documents, and its rows beside transformers'."""

from __future__ import annotations

import functools
import json
import random
import statistics
from pathlib import Path

import torch

from pairs import measure  # first: it puts tests/ and src/ on the path
from fidelity import fidelity_rows
from rerankit.engine import EmbeddedBackend
from rerankit.schema import ScoreRequest


def build_bert_large(folder: Path) -> tuple:
    """A BERT-large-shaped BertForSequenceClassification (random weights, bf16, on the GPU) and its tokenizer, saved
    in ``folder``, with W4's query and 100 documents of 64-448 words: (tokenizer, model, query, docs)."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    words = sorted({"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) for _ in range(5000)})
    vocab = {token: index for index, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    tokenizer = BertTokenizerFast(vocab=vocab)
    tokenizer.save_pretrained(folder)
    config = BertConfig(vocab_size=len(vocab), hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096, num_labels=1, max_position_embeddings=512)
    with torch.device("cuda"):
        model = BertForSequenceClassification(config).to(torch.bfloat16).eval()
    model.save_pretrained(folder)
    docs = [" ".join(rng.choice(words) for _ in range(rng.randrange(64, 448))) for _ in range(100)]
    return tokenizer, model, "capital france", docs


def bert_large_workload(root: Path, results: list[dict], repeats: int, fp8: bool = False) -> None:
    """W4 cross-encoder: a BERT-large-shaped BertForSequenceClassification, 1 query x 100 docs; with ``fp8`` also
    the FP8 engine's row and the fidelity rows against transformers in float32 (100 pairs)."""
    folder = root / "bert-large-ce-random"
    tokenizer, model, query, docs = build_bert_large(folder)
    backends = {"rerankit": EmbeddedBackend(str(folder), device="cuda", dtype="bfloat16")}
    if fp8:
        backends["rerankit-fp8"] = EmbeddedBackend(str(folder), device="cuda", dtype="fp8")
    request = ScoreRequest(query=query, items=docs, max_tokens_per_item=448)

    def baseline():
        inputs = tokenizer([query] * len(docs), docs, padding=True, truncation=True, max_length=512,
                           return_tensors="pt").to("cuda")
        return model(**inputs).logits

    calls = {name: functools.partial(backend.score, request) for name, backend in backends.items()}
    for name, fn in {**calls, "transformers-padded": baseline}.items():
        times, peak = measure(fn, repeats, 2)
        median = statistics.median(times)
        row = {"workload": "W4-bert-large", "variant": name, "pairs": 100, "pairs_per_s": 100 / median,
               "peak_gib": peak, "median_s": median}
        results.append(row)
        print(json.dumps(row), flush=True)
    if fp8:
        scores = {name: torch.tensor(fn().scores) for name, fn in calls.items()}
        scores["transformers-bf16-padded"] = torch.sigmoid(baseline().float()[:, 0]).cpu()
        fp32 = torch.sigmoid(model.float()(**tokenizer([query] * len(docs), docs, padding=True, truncation=True,
                                                       max_length=512, return_tensors="pt").to("cuda"))
                             .logits.float()[:, 0]).cpu()
        for row in fidelity_rows("W4-bert-large", scores, fp32, "rerankit"):
            results.append(row)
            print(json.dumps(row), flush=True)
    for backend in backends.values():
        backend.close()  # the baseline's model goes with this function's frame (its last use is the closure above)
