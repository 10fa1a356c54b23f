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
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bert_large import build_bert_large  # noqa: E402
from pairs import time_call  # noqa: E402

from rerankit.engine import EmbeddedBackend  # noqa: E402
from rerankit.schema import ScoreRequest  # noqa: E402


def build(folder: Path) -> ScoreRequest:
    """``pairs.py``'s W4 cross-encoder saved in ``folder``, and its request."""
    _, model, query, docs = build_bert_large(folder)
    del model  # the backends load it from the folder
    return ScoreRequest(query=query, items=docs, max_tokens_per_item=448)


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
