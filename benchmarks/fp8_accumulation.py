"""FP8 with cuBLAS's fast accumulation on and off (``fp8_matmul.FAST_ACCUM``: the o and down projections), in one
process on one GPU: pairs/s of W1's query with ``--docs`` documents, alternating the setting between rounds, and
each setting's fidelity against float32 (largest |score - fp32 score| and Spearman over 48 documents, as
``pairs.py`` measures it), beside bf16's.

    PYTHONPATH=src python benchmarks/fp8_accumulation.py --shape 4b --root /tmp/fp8 --docs 32

Each round times 15 calls after three warm-up calls; three rounds a setting. One JSON line a result.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity import FIDELITY_DOCS, spearman  # noqa: E402
from pairs import (  # noqa: E402
    QUERY,
    build_decoder_dir,
    decoder_workloads,
    make_docs,
    reference_scores,
    requests_of,
    single_token_words,
    time_call,
)

ROUNDS, CALLS, WARM_UP_CALLS = 3, 15, 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", required=True, help="0.6b, 4b or 8b (pairs.py's SHAPES)")
    parser.add_argument("--root", required=True, help="folder of the random-weight model (built when missing)")
    parser.add_argument("--docs", type=int, default=32, help="documents of the timed query (W1 has 100)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from rerankit.engine.backend import EmbeddedBackend
    from rerankit.kernels import fp8_matmul
    from rerankit.schema import ScoreRequest

    folder = Path(args.root) / f"qwen3-reranker-{args.shape}-random"
    if not folder.exists():
        build_decoder_dir(Path(args.root), args.shape)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"  # the reference's batches read each prompt's last position
    words = single_token_words(tokenizer)
    requests = requests_of(decoder_workloads(words, random.Random(0), {"W1"}, args.docs)[0], True)
    docs = make_docs(words, FIDELITY_DOCS, 64, 448, random.Random(1))
    fidelity_request = ScoreRequest(query=QUERY, items=docs, template="qwen3-reranker", multi_item=False)
    fp32 = reference_scores(folder, tokenizer, QUERY, docs)

    def report(label: str, scores: list[float]) -> None:
        values = torch.tensor(scores)
        print(json.dumps({"shape": args.shape, "variant": label, "max_abs_vs_fp32": float((values - fp32).abs().max()),
                          "spearman_vs_fp32": spearman(values, fp32)}), flush=True)

    bf16 = EmbeddedBackend(str(folder), device="cuda", dtype="bfloat16")
    report("bf16", bf16.score(fidelity_request).scores)
    bf16.close()
    backend = EmbeddedBackend(str(folder), device="cuda", dtype="fp8")
    rates: dict[bool, list[float]] = {False: [], True: []}
    for fast in (False, True):
        fp8_matmul.FAST_ACCUM = fast
        report(f"fp8 fast_accum={fast}", backend.score(fidelity_request).scores)
        for _ in range(WARM_UP_CALLS):
            backend.score_batch(requests)
    for _ in range(ROUNDS):
        for fast in (False, True):
            fp8_matmul.FAST_ACCUM = fast
            rates[fast].append(args.docs / statistics.median(time_call(lambda: backend.score_batch(requests), CALLS)))
    for fast, values in rates.items():
        print(json.dumps({"shape": args.shape, "variant": f"fp8 fast_accum={fast}", "pairs_per_s": values,
                          "median": statistics.median(values)}), flush=True)


if __name__ == "__main__":
    main()
