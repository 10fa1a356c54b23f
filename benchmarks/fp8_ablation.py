"""Which projections' FP8 rounding moves the scores: W1 documents scored by the transformers model in float32 with
e4m3 round trips (per-token activation scales, per-channel weight scales: what ``dtype="fp8"`` computes) applied
to chosen projections only, in plain torch with float32 sums, so the figures hold on any device and carry no
kernel's own error. Each row: the largest |score - float32 score|, the mean shift, and Spearman against float32;
the first row is the whole model in bf16, for scale. Two rows change the rounding, not the projections: bf16 round
trips on every projection (the same places rounded to 8 significant bits instead of e4m3's 4), and e4m3 with the
finest scales in use (DeepSeek-V3's blocks: one scale per 128 inputs of a token, per 128 x 128 weights).

    PYTHONPATH=src python benchmarks/fp8_ablation.py --shape 0.6b --docs 12     # ~10 minutes on a 2-core CPU
    PYTHONPATH=src python benchmarks/fp8_ablation.py --shape minilm            # real weights: the packaged MiniLM
    PYTHONPATH=src python benchmarks/fp8_ablation.py --rows "bf16,block"       # only the rows naming these
    PYTHONPATH=src python benchmarks/fp8_ablation.py --shape 8b --device cuda  # float32 on a GPU

``--shape minilm`` scores ``examples/docs.txt`` against a few queries with the packaged all-MiniLM-L6-v2 (real
weights; a bi-encoder, so the scores are cosine similarities), each query's Spearman taken alone and the worst
reported.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]
from fidelity import spearman  # noqa: E402
from pairs import build_decoder_dir, decoder_workloads, requests_of, single_token_words  # noqa: E402

from rerankit.engine import EmbeddedBackend  # noqa: E402
from rerankit.kernels.fp8_quant import dequantize_rows, quantize_rows_reference  # noqa: E402
from rerankit.schema import ScoreRequest  # noqa: E402


def round_trip(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` [.., d] quantized to float8_e4m3fn with one scale per row (as the engine does), and back."""
    rows = tensor.reshape(-1, tensor.shape[-1])
    return dequantize_rows(*quantize_rows_reference(rows)).reshape(tensor.shape)


def block_round_trip(tensor: torch.Tensor, block_rows: int, block_cols: int = 128) -> torch.Tensor:
    """``tensor`` [.., d] to float8_e4m3fn and back with one scale (largest |x| / 448) per ``block_rows`` x
    ``block_cols`` block (zero padded at the edges)."""
    rows = tensor.reshape(-1, tensor.shape[-1]).float()
    height, width = rows.shape
    padded = torch.nn.functional.pad(rows, (0, -width % block_cols, 0, -height % block_rows))
    blocks = padded.reshape(padded.shape[0] // block_rows, block_rows, padded.shape[1] // block_cols, block_cols)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12) / 448.0
    back = (blocks / scale).to(torch.float8_e4m3fn).float() * scale
    return back.reshape(padded.shape)[:height, :width].reshape(tensor.shape).to(tensor.dtype)


def bf16_round_trip(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.bfloat16).to(tensor.dtype)


QUERIES = ("What is the capital of France?", "Which tower was built for a world's fair?", "How do cars work?",
           "What do plants do with sunlight?", "Which is the highest mountain?")
DOCS_FILE = Path(__file__).resolve().parents[1] / "examples" / "docs.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.6b", help="a Qwen3-Reranker shape of benchmarks/pairs.py, or "
                        "'minilm': the packaged all-MiniLM-L6-v2's real weights")
    parser.add_argument("--docs", type=int, default=12, help="W1 documents scored")
    parser.add_argument("--device", default="cpu", help="where the float32 model runs: cpu, or cuda for the 4B "
                        "and 8B shapes (float32 sums either way: TF32 stays off)")
    parser.add_argument("--rows", default="", help="comma-separated words: only the rows whose label holds one "
                        "(the bf16 and float32 references always run)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    if args.shape == "minilm":
        from rerankit.defaults import default_model_path

        folder = Path(default_model_path())
        docs = DOCS_FILE.read_text().splitlines()
        requests = [ScoreRequest(query=query, items=docs) for query in QUERIES]
        args.docs = len(docs)
    else:
        folder = build_decoder_dir(Path(tempfile.mkdtemp()), args.shape)
        words = single_token_words(AutoTokenizer.from_pretrained(folder))
        requests = requests_of(decoder_workloads(words, random.Random(0), {"W1"}, w1_docs=args.docs)[0], True)[:1]

    def score(backend: EmbeddedBackend) -> list[torch.Tensor]:
        return [torch.tensor(response.scores, dtype=torch.float64) for response in backend.score_batch(requests)]

    torch.backends.cuda.matmul.allow_tf32 = False  # a float32 reference, not TF32's 10-bit products
    bf16 = EmbeddedBackend(str(folder), device=args.device, dtype="bfloat16", runner="reference",
                           show_progress=False)
    bf16_scores = score(bf16)
    bf16.close()
    backend = EmbeddedBackend(str(folder), device=args.device, dtype="float32", runner="reference",
                              show_progress=False)
    model = backend._model().model
    fp32 = score(backend)
    linears = {name: module for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and (".layers." in name or ".layer." in name)}
    originals = {name: module.weight.data.clone() for name, module in linears.items()}
    layers = model.config.num_hidden_layers

    def report(label: str, scores: list[torch.Tensor], seconds: float) -> None:
        shift = torch.cat([mine - reference for mine, reference in zip(scores, fp32)])
        worst = min(spearman(mine, reference) for mine, reference in zip(scores, fp32))
        print(json.dumps({"shape": args.shape, "queries": len(requests), "docs": args.docs, "variant": label,
                          "max_abs_vs_fp32": round(float(shift.abs().max()), 4),
                          "mean_shift": round(float(shift.mean()), 4), "spearman_vs_fp32": round(worst, 3),
                          "seconds": round(seconds)}), flush=True)

    wanted = [word.strip() for word in args.rows.split(",") if word.strip()]

    def run(label: str, picked: Callable[[str], bool], weights: bool = True, inputs: bool = True,
            rounding: tuple[Callable, Callable] = (round_trip, round_trip)) -> None:
        if wanted and not any(word in label for word in wanted):
            return
        hooks, weight_trip, input_trip = [], *rounding
        for name, module in linears.items():
            if picked(name):
                if weights:
                    module.weight.data = weight_trip(originals[name])
                if inputs:
                    hooks.append(module.register_forward_pre_hook(lambda _, given: (input_trip(given[0]),)))
        begun = time.perf_counter()
        try:
            scores = score(backend)
        finally:
            for hook in hooks:
                hook.remove()
            for name, module in linears.items():
                module.weight.data = originals[name]
        report(label, scores, time.perf_counter() - begun)

    def layer(name: str) -> int:
        return int(name.split(".layers.")[1].split(".")[0])

    report("bf16 (whole model)", bf16_scores, 0.0)
    run("FP8: every projection", lambda name: True)
    run("bf16 round trips on every projection (the FP8 row's places)", lambda name: True,
        rounding=(bf16_round_trip, bf16_round_trip))
    run("FP8 block scales on every projection (1 x 128 inputs, 128 x 128 weights)", lambda name: True,
        rounding=(lambda weight: block_round_trip(weight, 128), lambda given: block_round_trip(given, 1)))
    run("FP8 weights only", lambda name: True, inputs=False)
    run("FP8 inputs only", lambda name: True, weights=False)
    if args.shape == "minilm":
        return
    for part in ("q_proj|k_proj|v_proj", "o_proj", "gate_proj|up_proj", "down_proj"):
        run(f"FP8: {part} only", lambda name, part=part: any(piece in name for piece in part.split("|")))
    run("FP8: q/k/v and gate/up", lambda name: any(piece in name for piece in ("q_proj", "k_proj", "v_proj",
                                                                                "gate_proj", "up_proj")))
    run("FP8: all but the first and last 2 layers", lambda name: 2 <= layer(name) < layers - 2)


if __name__ == "__main__":
    main()
