"""Multi-item scoring vs per-pair scoring on the CPU (float32), the measurement behind MIS being the CPU default.

1 query x 50 items: an 80-token prefix, items of 30..120 tokens; median of 7 interleaved calls of each:

    PYTHONPATH=src python benchmarks/cpu_mis.py [tiny|small ...]
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rerankit.engine import EmbeddedBackend
from rerankit.schema import ScoreRequest

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64),
}


def make_model(folder: Path, shape: str) -> Path:
    """A random-weight Qwen3ForCausalLM of ``shape`` with the tiny chat tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import build_decoder_tokenizer

    tokenizer = build_decoder_tokenizer(folder)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=True,
                         **SHAPES[shape])
    Qwen3ForCausalLM(config).eval().save_pretrained(folder)
    return folder


def workload(vocab: int, seed: int = 0) -> ScoreRequest:
    """1 query x 50 items: an 80-token prefix, items of 30..120 token ids."""
    rng = random.Random(seed)
    return ScoreRequest(query=[rng.randrange(10, vocab) for _ in range(80)],
                        items=[[rng.randrange(10, vocab) for _ in range(rng.randint(30, 120))] for _ in range(50)],
                        label_token_ids=[30, 31])


def time_mis_and_pairs(path: Path, repeats: int) -> tuple[list[float], list[float], float]:
    """Seconds of each MIS and per-pair call (interleaved, so both see the same load) and their largest gap."""
    backends = [EmbeddedBackend(str(path), device="cpu", multi_item=shared) for shared in (True, False)]
    request = workload(backends[0]._model().vocab_size)
    first = [backend.score(request).scores for backend in backends]
    gap = max(abs(shared - alone) for shared, alone in zip(*first))
    timings: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for backend, times in zip(backends, timings):
            begun = time.perf_counter()
            backend.score(request)
            times.append(time.perf_counter() - begun)
    return timings[0], timings[1], gap


if __name__ == "__main__":
    for shape in sys.argv[1:] or ["tiny", "small"]:
        mis, pairs, gap = time_mis_and_pairs(make_model(Path(tempfile.mkdtemp()) / shape, shape), repeats=7)
        mis_ms, pairs_ms = statistics.median(mis) * 1000, statistics.median(pairs) * 1000
        print(f"{shape}: MIS {mis_ms:.1f} ms, pairs {pairs_ms:.1f} ms, MIS/pairs {mis_ms / pairs_ms:.2f}, "
              f"max |score gap| {gap:.1e} ({torch.get_num_threads()} threads)")
