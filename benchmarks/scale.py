"""Data-parallel scaling: pairs/s at 1..N engine replicas, through the public API and through ``rerankit serve``.

For each replica count N (one process per GPU, ``data_parallel_size=N``), on the Qwen3-Reranker-0.6B and 4B shapes
with random weights (built as ``benchmarks/pairs.py`` builds them):
  api W2     64 queries x 100 docs (64-448 tokens) in one ``score_batch`` call: pairs/s
  api W1xC   C client threads each sending W1 (1 query x 100 docs) for --duration s: pairs/s, p50/p99 latency
  serve      ``rerankit serve --data-parallel-size N`` under --clients concurrent HTTP clients (serve_load.py):
             pairs/s, p50/p99 latency
Each row carries its scaling efficiency against 1 replica of the same run (rate_N / (N x rate_1)) and, for the API
rows, the largest score difference against 1 replica. ``dp1`` is one replica behind the process boundary (what the
queues and pickling cost); 1 is the engine in this process. Start-up rows: seconds from spawn to ready per replica.

    python benchmarks/scale.py --replicas 1,2,4 --shapes 0.6b,4b --out scale.json   # a multi-GPU host
    python benchmarks/scale.py --smoke                                             # CPU, a tiny model, 1-2 replicas

Prints one JSON object per measurement, then a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent / "src")]
from pairs import Workload, build_decoder_dir, decoder_workloads, requests_of, single_token_words  # noqa: E402
from serve_load import free_port, percentile, run_load, wait_healthy  # noqa: E402

from rerankit.engine import EmbeddedBackend  # noqa: E402
from rerankit.engine.replicas import DataParallelBackend  # noqa: E402


def smoke_workloads(words: list[str], rng: random.Random) -> list[Workload]:
    """W1 and W2 cut down for a CPU: 40 docs of 16-64 words, W2 with 8 queries."""
    workloads = decoder_workloads(words, rng, {"W1", "W2"})
    for workload in workloads:
        workload.queries, workload.docs = workload.queries[:8], [docs[:40] for docs in workload.docs[:8]]
        workload.docs = [[" ".join(doc.split()[:rng.randrange(16, 64)]) for doc in docs] for docs in workload.docs]
    return workloads


def open_backend(folder: Path, replicas: int | str, device: str) -> tuple[object, float]:
    """The backend for a row (1: the engine in this process; "dp1": one replica process) and its start seconds."""
    begun = time.perf_counter()
    if replicas == 1:
        backend = EmbeddedBackend(str(folder), device=device, show_progress=False)
    else:
        backend = DataParallelBackend(str(folder), device=device, data_parallel_size=1 if replicas == "dp1" else replicas)
    return backend, time.perf_counter() - begun


def throughput(backend, workload: Workload, repeats: int) -> tuple[float, list[list[float]]]:
    """pairs/s of W2 as one call (median of ``repeats``), and the scores."""
    requests = requests_of(workload, True)
    pairs = sum(len(request.items) for request in requests)
    times, scores = [], []
    for _ in range(repeats):
        begun = time.perf_counter()
        scores = [response.scores for response in backend.score_batch(requests)]
        times.append(time.perf_counter() - begun)
    return pairs / statistics.median(times), scores


def concurrent_clients(backend, workload: Workload, clients: int, duration: float) -> dict:
    """``clients`` threads each scoring W1 in a loop for ``duration`` s: pairs/s and latency percentiles."""
    request = requests_of(workload, True)[0]
    latencies: list[float] = []
    deadline = time.perf_counter() + duration

    def client() -> None:
        while time.perf_counter() < deadline:
            begun = time.perf_counter()
            backend.score(request)
            latencies.append(time.perf_counter() - begun)

    begun = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - begun
    return {"pairs_per_s": len(latencies) * len(request.items) / elapsed,
            "p50_ms": percentile(latencies, 0.5) * 1000, "p99_ms": percentile(latencies, 0.99) * 1000}


def max_difference(scores: list[list[float]], reference: list[list[float]]) -> float:
    return max(abs(a - b) for mine, theirs in zip(scores, reference) for a, b in zip(mine, theirs))


def serve_row(folder: Path, replicas: int, args: argparse.Namespace) -> dict:
    """``rerankit serve --data-parallel-size N`` in a subprocess under ``--clients`` HTTP clients."""
    port = free_port()
    command = [sys.executable, "-m", "rerankit", "serve", "--model", str(folder), "--device", args.device,
               "--port", str(port), "--log-level", "warning", "--data-parallel-size", str(replicas),
               "--max-queue-requests", str(max(256, 2 * args.clients))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    server = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        ready = wait_healthy(server, url, 900)
        load = asyncio.run(run_load(url, "/rerank", args.clients, args.duration, args.serve_docs, args.serve_words,
                                    None))
    finally:
        server.terminate()
        server.wait(60)
    return {"pairs_per_s": load["items_per_s"], "p50_ms": load["latency_p50_ms"], "p99_ms": load["latency_p99_ms"],
            "errors": load["errors"], "ready_s": ready}


def run_shape(shape: str, folder: Path, words: list[str], args: argparse.Namespace, results: list[dict]) -> None:
    rng = random.Random(0)
    w1, w2 = smoke_workloads(words, rng) if args.smoke else decoder_workloads(words, rng, {"W1", "W2"})
    counts: list[int | str] = [1] + ([] if args.no_dp1 else ["dp1"]) + [n for n in args.replicas if n > 1]
    base: dict[str, dict] = {}
    reference: list[list[float]] | None = None

    def emit(row: dict) -> None:
        metric = row["variant"]
        replicas = 1 if row["replicas"] == "dp1" else row["replicas"]
        if row["replicas"] == 1:
            base[metric] = row
        if metric in base:
            row["efficiency"] = round(row["pairs_per_s"] / (replicas * base[metric]["pairs_per_s"]), 3)
        results.append({"shape": shape, **row})
        print(json.dumps(results[-1]), flush=True)

    for replicas in counts:
        backend, started = open_backend(folder, replicas, args.device)
        startup = getattr(backend, "startup_seconds", None)
        results.append({"shape": shape, "replicas": replicas, "start_s": round(started, 2),
                        "replica_startup_s": startup, "warm_up_s": round(backend.warm_up(), 2)})
        print(json.dumps(results[-1]), flush=True)
        try:
            rate, scores = throughput(backend, w2, args.repeats)
            reference = scores if replicas == 1 else reference
            emit({"variant": "api W2", "replicas": replicas, "pairs_per_s": round(rate, 1),
                  "max_score_diff": max_difference(scores, reference)})
            clients = concurrent_clients(backend, w1, args.clients, args.duration)
            emit({"variant": f"api W1x{args.clients}", "replicas": replicas, **clients})
        finally:
            backend.close()
    if not args.no_serve:
        for replicas in [1] + [n for n in args.replicas if n > 1]:
            emit({"variant": f"serve x{args.clients}", "replicas": replicas, **serve_row(folder, replicas, args)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default=None, help="replica counts, e.g. 1,2,4 (default: 1 to every GPU)")
    parser.add_argument("--shapes", default="0.6b,4b", help="Qwen3-Reranker shapes with random weights")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (threads / HTTP)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of each concurrent-client row")
    parser.add_argument("--repeats", type=int, default=3, help="W2 calls timed (the median counts)")
    parser.add_argument("--serve-docs", type=int, default=100, help="documents a serve request")
    parser.add_argument("--serve-words", type=int, default=200, help="words a served document")
    parser.add_argument("--no-serve", action="store_true", help="skip the rerankit serve rows")
    parser.add_argument("--no-dp1", action="store_true", help="skip the row of one replica behind a process")
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny model, small workloads, 1-2 replicas")
    parser.add_argument("--out", default=None, help="write every row as a JSON list here")
    args = parser.parse_args()
    import torch
    from transformers import AutoTokenizer

    from tiny_models import make_qwen3_causal_lm

    args.device = "cpu" if args.smoke else "cuda"
    gpus = torch.cuda.device_count()
    args.replicas = [int(n) for n in (args.replicas or ("1,2" if args.smoke else ",".join(
        str(n) for n in (1, 2, 4, 8) if n <= gpus))).split(",")]
    if args.smoke:
        args.clients, args.duration, args.repeats = min(args.clients, 4), min(args.duration, 5.0), 1
        args.serve_docs, args.serve_words = min(args.serve_docs, 20), min(args.serve_words, 32)
    results: list[dict] = [{"device": torch.cuda.get_device_name() if gpus else "cpu", "gpus": gpus,
                            "cpus": os.cpu_count(), "torch": torch.__version__, "replicas": args.replicas}]
    print(json.dumps(results[0]), flush=True)
    root = Path(tempfile.mkdtemp(prefix="rerankit-scale-"))
    for shape in ["tiny"] if args.smoke else args.shapes.split(","):
        folder = make_qwen3_causal_lm(root) if args.smoke else build_decoder_dir(root, shape)
        words = single_token_words(AutoTokenizer.from_pretrained(folder))
        run_shape(shape, folder, words, args, results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print_table(results)


def print_table(results: list[dict]) -> None:
    print(f"\n{'shape':<6} {'variant':<14} {'replicas':>8} {'pairs/s':>10} {'eff':>6} {'p50 ms':>9} {'p99 ms':>9} "
          f"{'max diff':>9}")
    for row in results:
        if "variant" in row:
            print(f"{row['shape']:<6} {row['variant']:<14} {row['replicas']!s:>8} {row['pairs_per_s']:>10.1f} "
                  f"{row.get('efficiency', float('nan')):>6.2f} {row.get('p50_ms', float('nan')):>9.1f} "
                  f"{row.get('p99_ms', float('nan')):>9.1f} {row.get('max_score_diff', float('nan')):>9.2e}")
    for row in results:
        if "start_s" in row:
            print(f"{row['shape']}: {row['replicas']} replica(s) ready in {row['start_s']} s "
                  f"(per replica {row['replica_startup_s']}), warm-up {row['warm_up_s']} s")


if __name__ == "__main__":
    main()
