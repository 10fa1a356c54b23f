"""The ramp-up's worth by request size: W1's query with N documents (``pairs.py``'s lengths), calls timed under three
plans, alternated round by round in one process (``EmbeddedBackend._ramp_closes``):
  engine   the engine's own choice (the first 16 items apart only where the request is larger than one CUDA graph);
  split    the first 16 items always apart (the rule before that choice);
  off      no ramp-up: one tokenizer call, then the micro-batches.

    PYTHONPATH=src python benchmarks/ramp.py --shape 4b --docs 32,64,100 [--dtypes bfloat16,fp8] [--rounds 4]

Prints, per dtype and size, the median over rounds of each round's median call (ms) and the micro-batches' tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairs import DEVICE, build_decoder_dir, decoder_workloads, requests_of, single_token_words, time_call  # noqa: E402

from rerankit.engine import EmbeddedBackend  # noqa: E402
from rerankit.engine.backend import _Call  # noqa: E402

PLANS = {"engine": (None, None), "split": (True, True), "off": (False, None)}  # backend._ramp, _ramp_closes forced


def run_plan(backend: EmbeddedBackend, plan: str) -> None:
    """Set ``backend`` to ``plan`` (the module's docstring); "engine" puts the engine's own choice back."""
    ramp, closes = PLANS[plan]
    backend._ramp = ramp
    if closes is not None:
        backend._ramp_closes = lambda *args: closes
    else:
        backend.__dict__.pop("_ramp_closes", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.6b", help="pairs.py's SHAPES: 0.6b, 4b, 8b (tiny on a CPU)")
    parser.add_argument("--docs", default="32,64,100", help="comma-separated document counts")
    parser.add_argument("--dtypes", default="bfloat16,fp8")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=11, help="timed calls a plan a round")
    args = parser.parse_args()
    folder = build_decoder_dir(Path(tempfile.mkdtemp(prefix="rerankit-ramp-")), args.shape)
    sizes = [int(count) for count in args.docs.split(",")]
    print(json.dumps({"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "shape": args.shape}))
    for dtype in args.dtypes.split(","):
        backend = EmbeddedBackend(str(folder), device=DEVICE, dtype=dtype if DEVICE == "cuda" else None)
        loaded = backend._model()
        words = single_token_words(loaded.tokenizer)
        calls = {count: requests_of(decoder_workloads(words, random.Random(0), {"W1"}, count)[0], True)
                 for count in sizes}
        times: dict[tuple[int, str], list[float]] = {(count, plan): [] for count in sizes for plan in PLANS}
        with torch.inference_mode():
            for round_index in range(args.rounds):
                for count in sizes:
                    for plan in PLANS:
                        run_plan(backend, plan)
                        for _ in range(3 if round_index == 0 else 1):  # compiles, tunes and captures first
                            backend.score_batch(calls[count])
                        times[(count, plan)].append(
                            1e3 * statistics.median(time_call(lambda: backend.score_batch(calls[count]), args.calls)))
            for count in sizes:
                row = {"dtype": dtype, "docs": count}
                for plan in PLANS:
                    run_plan(backend, plan)
                    row[f"{plan}_ms"] = round(statistics.median(times[(count, plan)]), 2)
                    row[f"{plan}_rounds"] = [round(value, 2) for value in times[(count, plan)]]
                    row[f"{plan}_batches"] = [micro.batch.num_tokens
                                              for micro in backend._plan(_Call(calls[count]), loaded, False)]
                print(json.dumps(row), flush=True)
        run_plan(backend, "engine")
        backend.close()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
