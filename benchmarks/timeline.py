"""Where a call's wall time goes, without a profiler: host time to each micro-batch's launch, and the GPU's time.

For W1, W3 and LI (``pairs.py``'s workloads, Qwen3-Reranker-0.6B shape by default, random weights), on the GPU:
  wall_ms        median wall time of a ``score_batch`` call (15 calls after 3 warm-ups);
  launches       for two instrumented calls, each micro-batch's (event, host ms, GPU ms, tokens): "enter" when the
                 runner is called for it (host clock) and when the GPU reaches that point of the stream (a CUDA event
                 recorded there), "exit" when the runner returns (its launches are queued) and when the GPU has run
                 them; both clocks count from the call's start;
  gpu_bound_ms   the same micro-batches, planned beforehand, launched back to back (median of 10): the GPU's time
                 with the host out of the way;
  plan_ms        the call's encoding and planning alone, no model (median of 10).
The profiler slows the host and so overstates the GPU's idle time; these numbers do not.

``--ab`` instead times wall_ms and gpu_bound_ms of each workload under each engine setting of ``AB_SETTINGS`` (model
switches, attention kernel configs, the largest graphed micro-batch, the micro-batch budget, the ramp-up's chunk
sizes, the template head's ids kept or not, its keys and values kept or not, cut to whole key tiles or not), the
settings interleaved over ``--rounds`` rounds so that a drifting clock or host falls on all of them alike; each
setting gets CUDA graphs of its own (a graph keeps the kernels it was captured with).

    PYTHONPATH=src python benchmarks/timeline.py [--out timeline.json] [--ab [--rounds 3] [--settings ramp,norms]]
        [--shape 4b --docs 32 --workloads W1] [--dtype fp8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairs import build_decoder_dir, decoder_workloads, requests_of, single_token_words, time_call  # noqa: E402

from rerankit.engine import EmbeddedBackend, encode  # noqa: E402
from rerankit.engine import backend as backend_module  # noqa: E402
from rerankit.engine import prefix_cache as prefix_cache_module  # noqa: E402
from rerankit.engine.backend import _Call  # noqa: E402
from rerankit.engine.graphs import MAX_GRAPH_TOKENS  # noqa: E402
from rerankit.engine.runner import graphed_forward  # noqa: E402
from rerankit.kernels.attention_config import CONFIG_ENV  # noqa: E402

@dataclass(frozen=True)
class Setting:
    """One engine setting of ``--ab``: PackedDecoder attributes, RERANKIT_ATTENTION_CONFIG, the largest graphed
    micro-batch in tokens, the ramp-up's chunk sizes, whether its later chunks are tokenized ahead on a worker
    thread, whether a template's head is tokenized once, whether its
    keys and values are kept across calls (``engine.prefix_cache``), the multiple a kept head is cut to, and
    environment variables."""

    model: dict = field(default_factory=dict)
    attention: str = ""
    graph_tokens: int = MAX_GRAPH_TOKENS
    ramp_tokens: int | None = None  # the graph size a ramp chunk's projected request is held to (None: graph_tokens)
    ramp_chunks: tuple[int, ...] = backend_module.RAMP_CHUNKS
    head_cache: bool = True
    prefix_cache: bool = True
    ramp: bool | None = None  # EmbeddedBackend's ramp-up: None where it pays, False never
    kept_multiple: int = prefix_cache_module.KEPT_HEAD_MULTIPLE  # a kept head is cut to a multiple of these tokens
    ramp_long_prefixes: bool = False  # ramp up requests whose instruction is long too (LI, its head kept)
    max_batch_tokens: int | None = None  # the micro-batch budget (None: the backend's own)
    tokenize_ahead: bool = True  # a ramped request's later chunks tokenized on a worker thread (False: when planned)
    env: dict = field(default_factory=dict)  # environment variables read on each call


AB_SETTINGS = {
    "default (ramp-up 16 items, head kept)": Setting(),
    "ramp-up 8 items": Setting(ramp_chunks=(8,)),
    "ramp-up 12 items": Setting(ramp_chunks=(12,)),
    "ramp-up 24 items": Setting(ramp_chunks=(24,)),
    "ramp-up 16 then 32 items": Setting(ramp_chunks=(16, 32)),
    "head tokenized each request": Setting(head_cache=False),
    "head's keys computed each call": Setting(prefix_cache=False),
    "compiled norms (no Triton RMSNorm)": Setting(model={"triton_norms": False}),
    "cuBLAS qkv + q/k kernel (no fused_qkv_rope)": Setting(model={"fused_qkv_rope": False}),
    "last layer attends every row (no last_layer_reads)": Setting(model={"last_layer_reads": False}),
    "Triton tile for long keys (no warp-specialized attention)": Setting(attention="warp_specialized=0"),
    "no ramp-up": Setting(ramp=False),
    "later chunks tokenized when planned (not ahead)": Setting(tokenize_ahead=False),
    "graphs up to 16,384 tokens": Setting(graph_tokens=16384),
    "graphs up to 24,576 tokens": Setting(graph_tokens=24576),
    "graphs up to 24,576 tokens, ramp-up as at 8,192 (rest graphed)": Setting(graph_tokens=24576, ramp_tokens=8192),
    "ramp-up 8 items, rest graphed": Setting(graph_tokens=24576, ramp_tokens=8192, ramp_chunks=(8,)),
    "budget of 8,192 tokens (every micro-batch graphed)": Setting(max_batch_tokens=8192),
    "budget and graphs of 16,384 tokens": Setting(graph_tokens=16384, max_batch_tokens=16384),
    "ramp-up for long instructions too": Setting(ramp_long_prefixes=True),
    "kept heads uncut (no whole key tiles)": Setting(kept_multiple=1),
    "Triton's own launches (RERANKIT_DIRECT_LAUNCH=0)": Setting(env={"RERANKIT_DIRECT_LAUNCH": "0"}),
    "later layers replay the first's launches (RERANKIT_LAUNCH_REPLAY=1)": Setting(env={"RERANKIT_LAUNCH_REPLAY": "1"}),
}


@contextlib.contextmanager
def applied(setting: Setting, backend: EmbeddedBackend):
    """The backend under ``setting``, with graphs of its own; everything put back on exit."""
    runner = backend._runner
    model, graphs, prefix_cache = runner.model, runner.graphs, runner.prefix_cache
    saved = {name: getattr(model, name) for name in setting.model}
    ramp_chunks, head_ids = backend_module.RAMP_CHUNKS, encode._head_ids
    kept_multiple = prefix_cache_module.KEPT_HEAD_MULTIPLE
    ramp_pays = backend_module.EmbeddedBackend.__dict__["_ramp_pays"]  # the staticmethod itself
    budget = backend.max_batch_tokens
    environment = {name: os.environ.get(name) for name in setting.env}
    ramp_closes = backend_module.EmbeddedBackend._ramp_closes
    try:
        if setting.ramp_tokens:
            def closes(self, *args, _limit=setting.ramp_tokens):
                graphs, limit = self._runner.graphs, self._runner.graphs.max_tokens
                graphs.max_tokens = _limit
                try:
                    return ramp_closes(self, *args)
                finally:
                    graphs.max_tokens = limit
            backend_module.EmbeddedBackend._ramp_closes = closes
        os.environ.update(setting.env)
        if setting.ramp_long_prefixes:
            backend_module.EmbeddedBackend._ramp_pays = staticmethod(lambda request: True)
        for name, value in setting.model.items():
            setattr(model, name, value)
        os.environ[CONFIG_ENV] = setting.attention
        backend_module.RAMP_CHUNKS = setting.ramp_chunks
        if not setting.head_cache:
            encode._head_ids = lambda *args: None
        if not setting.prefix_cache:
            runner.prefix_cache = None
        backend._ramp = setting.ramp
        backend._tokenize_later_chunks = setting.tokenize_ahead
        backend.max_batch_tokens = setting.max_batch_tokens or budget
        prefix_cache_module.KEPT_HEAD_MULTIPLE = setting.kept_multiple
        runner.graphs = graphed_forward(model, runner.device, setting.graph_tokens) if graphs is not None else None
        yield
    finally:
        for name, value in saved.items():
            setattr(model, name, value)
        os.environ.pop(CONFIG_ENV, None)
        backend_module.RAMP_CHUNKS, encode._head_ids = ramp_chunks, head_ids
        runner.graphs, runner.prefix_cache = graphs, prefix_cache
        backend._ramp = None
        backend._tokenize_later_chunks = True
        backend.max_batch_tokens = budget
        prefix_cache_module.KEPT_HEAD_MULTIPLE = kept_multiple
        backend_module.EmbeddedBackend._ramp_pays = ramp_pays
        backend_module.EmbeddedBackend._ramp_closes = ramp_closes
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def median_ms(fn, repeats: int) -> float:
    return 1e3 * statistics.median(time_call(fn, repeats))


def instrumented_call(backend: EmbeddedBackend, requests: list) -> dict:
    """One call with each micro-batch's launch marked on the host clock and on the GPU's stream."""
    runner = backend._runner
    forward_read = runner.forward_read
    marks = []

    def marked(batch):
        marks.append(("enter", time.perf_counter(), _event(), batch.num_tokens))
        out = forward_read(batch)
        marks.append(("exit", time.perf_counter(), _event(), batch.num_tokens))
        return out

    torch.cuda.synchronize()
    start_event, start = _event(), time.perf_counter()
    runner.forward_read = marked
    try:
        backend.score_batch(requests)
    finally:
        runner.forward_read = forward_read
    returned = time.perf_counter()
    end_event = _event()
    torch.cuda.synchronize()
    return {"launches": [(kind, round(1e3 * (host - start), 2), round(start_event.elapsed_time(event), 2), tokens)
                         for kind, host, event, tokens in marks],
            "host_return_ms": round(1e3 * (returned - start), 2),
            "gpu_end_ms": round(start_event.elapsed_time(end_event), 2)}


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def gpu_bound_ms(backend: EmbeddedBackend, loaded, requests: list, repeats: int = 10) -> float:
    """The call's micro-batches, planned beforehand, launched back to back: the GPU's time alone."""
    micro_batches = list(backend._plan(_Call(requests), loaded, False))

    def launch_all():
        for micro in micro_batches:
            backend._runner.forward_read(micro.batch)

    return median_ms(launch_all, repeats)


def ab_rows(backend: EmbeddedBackend, loaded, workloads: list, rounds: int, settings: dict) -> list[dict]:
    """wall_ms / gpu_bound_ms of every workload under every setting of ``settings``, one round after another."""
    rows = []
    for round_index in range(rounds):
        for name, setting in settings.items():
            row = {"setting": name, "round": round_index}
            with applied(setting, backend):
                for workload in workloads:
                    requests = requests_of(workload, True)
                    for _ in range(2):
                        backend.score_batch(requests)
                    row[f"{workload.name}_wall_ms"] = round(median_ms(lambda: backend.score_batch(requests), 15), 2)
                    row[f"{workload.name}_gpu_bound_ms"] = round(gpu_bound_ms(backend, loaded, requests), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W1,W3,LI")
    parser.add_argument("--ab", action="store_true", help="compare the engine settings of AB_SETTINGS instead")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --ab")
    parser.add_argument("--settings", default="", help="--ab: only the settings whose name contains one of these "
                        "comma-separated words (the default setting always runs)")
    parser.add_argument("--shape", default="0.6b", help="the model shape (pairs.py's SHAPES: 0.6b, 4b, 8b)")
    parser.add_argument("--dtype", default="bfloat16", help="the engine's dtype: bfloat16 or fp8")
    parser.add_argument("--docs", type=int, default=100, help="W1's documents")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    folder = build_decoder_dir(Path(tempfile.mkdtemp(prefix="rerankit-timeline-")), args.shape)
    backend = EmbeddedBackend(str(folder), device="cuda", dtype=args.dtype)
    loaded = backend._model()
    workloads = decoder_workloads(single_token_words(loaded.tokenizer), random.Random(0),
                                  set(args.workloads.split(",")), args.docs)
    rows = [{"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
             "dtype": args.dtype}]
    print(json.dumps(rows[0]), flush=True)
    with torch.inference_mode():
        if args.ab:
            words = [word for word in args.settings.split(",") if word]
            settings = {name: setting for index, (name, setting) in enumerate(AB_SETTINGS.items())
                        if index == 0 or not words or any(word in name for word in words)}
            rows += ab_rows(backend, loaded, workloads, args.rounds, settings)
            workloads = []
        for workload in workloads:
            requests = requests_of(workload, True)
            for _ in range(3):
                backend.score_batch(requests)
            wall = median_ms(lambda: backend.score_batch(requests), 15)
            calls = [instrumented_call(backend, requests) for _ in range(2)]
            gpu_bound = gpu_bound_ms(backend, loaded, requests)
            plan = median_ms(lambda: list(backend._plan(_Call(requests), loaded, False)), 10)
            tokens = [m.batch.num_tokens for m in backend._plan(_Call(requests), loaded, False)]
            row = {"workload": workload.name, "wall_ms": round(wall, 2), "gpu_bound_ms": round(gpu_bound, 2),
                   "plan_ms": round(plan, 2), "micro_batch_tokens": tokens, "instrumented_calls": calls}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
