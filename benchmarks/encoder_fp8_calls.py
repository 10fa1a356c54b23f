"""Pairs/s of a BERT-large-shaped cross-encoder (random weights, 100 documents of 64-448 words, as ``pairs.py``'s W4
row builds it) in bf16 and in FP8, the two backends loaded in one process and alternated round by round, so that a
drifting host falls on both alike.

    PYTHONPATH=src python benchmarks/encoder_fp8_calls.py [--rounds 5] [--calls 12]

Prints each backend's pairs/s of every round (the median of ``--calls`` calls) and their medians. Needs a GPU with FP8
tensor cores.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairs import time_call  # noqa: E402

from rerankit.engine import EmbeddedBackend  # noqa: E402
from rerankit.schema import ScoreRequest  # noqa: E402


def build(folder: Path) -> ScoreRequest:
    """The W4 cross-encoder of ``pairs.bert_large_workload`` saved in ``folder``, and its request."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    rng = random.Random(1)
    words = sorted({"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) for _ in range(5000)})
    vocab = {token: index for index, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    BertTokenizerFast(vocab=vocab).save_pretrained(folder)
    config = BertConfig(vocab_size=len(vocab), hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096, num_labels=1, max_position_embeddings=512)
    with torch.device("cuda"):
        BertForSequenceClassification(config).to(torch.bfloat16).eval().save_pretrained(folder)
    docs = [" ".join(rng.choice(words) for _ in range(rng.randrange(64, 448))) for _ in range(100)]
    return ScoreRequest(query="capital france", items=docs, max_tokens_per_item=448)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=12, help="timed calls a round and backend")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="rerankit-bert-large-"))
    request = build(folder)
    backends = {dtype: EmbeddedBackend(str(folder), device="cuda", dtype=dtype) for dtype in ("bfloat16", "fp8")}
    rates: dict[str, list[float]] = {dtype: [] for dtype in backends}
    with torch.inference_mode():
        for backend in backends.values():
            for _ in range(3):
                backend.score(request)
        for _ in range(args.rounds):
            for dtype, backend in backends.items():
                backend.score(request)
                call = functools.partial(backend.score, request)
                rates[dtype].append(len(request.items) / statistics.median(time_call(call, args.calls)))
    print(f"device {torch.cuda.get_device_name()}")
    for dtype, values in rates.items():
        print(f"bert-large {dtype} pairs/s {' '.join(f'{rate:.1f}' for rate in values)} "
              f"median {statistics.median(values):.1f}", flush=True)


if __name__ == "__main__":
    main()
