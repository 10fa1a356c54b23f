"""Host time of planning (``engine.plan.plan_requests``, the micro-batches built and consumed) on a CPU: W1's 100
documents of 64-448 tokens after a 76-token prefix, with the prefix shared (MIS) and as pairs, and 100 typed
cross-encoder pairs (query, document, segment ids). Median of ``--repeats`` plans each, ms.

    PYTHONPATH=src python benchmarks/plan_host.py [--repeats 50]

Run it with another tree's ``src`` on PYTHONPATH to compare two versions of the planner on one machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from rerankit.engine.encode import EncodedRequest
from rerankit.engine.plan import RequestParts, plan_requests


def median_ms(make_parts, repeats: int, causal: bool) -> float:
    timings = []
    for _ in range(repeats):
        parts = make_parts()
        begun = time.perf_counter()
        list(plan_requests(parts, 32768, padded=False, causal=causal))
        timings.append(time.perf_counter() - begun)
    return 1000 * statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    items = [rng.integers(0, 150_000, int(length)).tolist() for length in rng.integers(64, 448, 100)]
    encoded = EncodedRequest("generative", list(range(76)), items, list(range(12)), [1, 2], read_first=False)
    typed = EncodedRequest("cross-encoder", [101, 5, 6, 102], items, [102], [], read_first=True,
                           prefix_types=[0] * 4, item_type=1, suffix_types=[1])
    cases = {
        "W1, MIS (shared prefix)": (lambda: [RequestParts.from_encoded(encoded, share_prefix=True)], True),
        "W1, pairs": (lambda: [RequestParts.from_encoded(encoded)], True),
        "100 cross-encoder pairs, typed": (lambda: [RequestParts.from_encoded(typed)], False),
    }
    for name, (make_parts, causal) in cases.items():
        print(f"{name}: {median_ms(make_parts, args.repeats, causal):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
