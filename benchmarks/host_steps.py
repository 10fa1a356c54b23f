"""Host time of each step of an eager forward, with the GPU never waited on (GPU).

For W1's large micro-batch and LI's (``pairs.py``'s workloads, Qwen3-Reranker-0.6B shape, random weights): the host
time to launch one eager ``forward_read`` and the time until the GPU is done; then, on LI's batch, the host time of
each launching step a call (the Triton kernels' Python wrappers, cuBLAS projections), by wrapping them. Where the
launch time nears the GPU time, an eager micro-batch is bound by its launches, not by the GPU.

    PYTHONPATH=src python benchmarks/host_steps.py
"""

from __future__ import annotations

import collections
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairs import build_decoder_dir, decoder_workloads, requests_of, single_token_words  # noqa: E402

import rerankit.engine.attention as attention_module  # noqa: E402
import rerankit.kernels.qk_norm_rope as qk_module  # noqa: E402
import rerankit.kernels.qkv_rope_matmul as qkv_module  # noqa: E402
import rerankit.kernels.rms_norm as norm_module  # noqa: E402
import rerankit.kernels.swiglu_matmul as swiglu_module  # noqa: E402
from rerankit.engine import EmbeddedBackend  # noqa: E402
from rerankit.engine.backend import _Call  # noqa: E402
from rerankit.engine.models import decoder as decoder_module  # noqa: E402

seconds: collections.Counter = collections.Counter()
calls: collections.Counter = collections.Counter()


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        seconds[name] += time.perf_counter() - start
        calls[name] += 1
        return out
    return wrapper


def main() -> None:
    folder = build_decoder_dir(Path(tempfile.mkdtemp(prefix="rerankit-host-")), "0.6b")
    backend = EmbeddedBackend(str(folder), device="cuda", dtype="bfloat16")
    loaded = backend._model()
    workloads = {w.name: w for w in decoder_workloads(single_token_words(loaded.tokenizer), random.Random(0),
                                                      {"W1", "LI"})}
    model, runner = backend._runner.model, backend._runner
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}))
    with torch.inference_mode():
        for name in ("W1", "LI"):
            requests = requests_of(workloads[name], True)
            for _ in range(3):
                backend.score_batch(requests)
            micro = list(backend._plan(_Call(requests), loaded, False))[-1]  # the largest, eager one
            batch = runner._on_device(micro.batch)
            kept = None if batch.cached_head is None else runner.prefix_cache.get(batch.cached_head,
                                                                                   model.keep_prefix)
            launches, totals = [], []
            for _ in range(8):
                torch.cuda.synchronize()
                start = time.perf_counter()
                model.forward_read(batch, cached_kv=kept)
                launches.append(1e3 * (time.perf_counter() - start))
                torch.cuda.synchronize()
                totals.append(1e3 * (time.perf_counter() - start))
            print(json.dumps({"workload": name, "tokens": batch.num_tokens,
                              "host_launch_ms": round(statistics.median(launches), 2),
                              "launch_and_gpu_ms": round(statistics.median(totals), 2)}), flush=True)
        attention_module.prefix_attention = timed("prefix_attention", attention_module.prefix_attention)
        qk_module.qk_norm_rope = timed("qk_norm_rope", qk_module.qk_norm_rope)
        qkv_module.qkv_rope_matmul = timed("qkv_rope_matmul", qkv_module.qkv_rope_matmul)
        norm_module.rms_norm = timed("rms_norm (Triton)", norm_module.rms_norm)
        swiglu_module.swiglu_matmul = timed("swiglu_matmul", swiglu_module.swiglu_matmul)
        decoder_module._add_projection = timed("addmm_ projection", decoder_module._add_projection)
        model._qkv_projection = timed("norm + q/k/v (compiled)", model._qkv_projection)
        model._rms_norm = timed("norm (compiled)", model._rms_norm)
        for _ in range(5):
            model.forward_read(batch, cached_kv=kept)
            torch.cuda.synchronize()
    print(json.dumps({"host_us_a_call": {name: round(1e6 * seconds[name] / calls[name], 1) for name in seconds},
                      "calls_a_forward": {name: calls[name] // 5 for name in calls}}))


if __name__ == "__main__":
    main()
