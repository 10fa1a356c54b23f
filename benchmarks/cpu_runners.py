"""Our packed forward vs the transformers reference runner on the CPU, on the packaged MiniLM by default.

1 query x 100 documents of 20-200 words drawn from examples/docs.txt; median of 5 calls after a warm-up; also the
largest score difference between the two runners.

    PYTHONPATH=src python benchmarks/cpu_runners.py [--model PATH] [--docs 100]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from rerankit.defaults import default_model_path
from rerankit.engine import EmbeddedBackend
from rerankit.schema import ScoreRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the packaged MiniLM)")
    parser.add_argument("--docs", type=int, default=100)
    args = parser.parse_args()
    words = (Path(__file__).resolve().parents[1] / "examples" / "docs.txt").read_text().split()
    rng = random.Random(0)
    documents = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 200))) for _ in range(args.docs)]
    request = ScoreRequest(query="What is the capital of France?", items=documents)
    scores, row = {}, {"threads": torch.get_num_threads(), "docs": args.docs}
    for runner in ("auto", "reference"):
        backend = EmbeddedBackend(args.model or default_model_path(), device="cpu", runner=runner)
        backend.score(request)
        times = []
        for _ in range(5):
            begun = time.perf_counter()
            scores[runner] = backend.score(request).scores
            times.append(time.perf_counter() - begun)
        row[f"{backend.runner}_ms"] = 1000 * statistics.median(times)
        backend.close()
    row["max_abs_score_diff"] = max(abs(a - b) for a, b in zip(scores["auto"], scores["reference"]))
    print(json.dumps(row))


if __name__ == "__main__":
    main()
