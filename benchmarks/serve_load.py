"""Load test for ``rerankit serve``: N concurrent clients for a fixed time, throughput and latency as JSON.

Against a running server:
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --clients 16 --duration 10
Starting its own server (a subprocess, so that the clients do not share its interpreter):
    python benchmarks/serve_load.py --model PATH [--no-batching] --clients 16 --duration 10
Both ways, side by side, with the speed-up batching gives (runs alternate; the median run of each is shown):
    python benchmarks/serve_load.py --model PATH --compare --repeats 3 --threads 1
One server, one row (a JSON line) per number of clients, each after a short warm-up:
    python benchmarks/serve_load.py --model PATH --sweep 16,32,64,128,256 --duration 10
A fresh server: the first ``--duration`` seconds (15 by default here) after ``/health`` answers, no warm-up:
    python benchmarks/serve_load.py --model PATH --cold --clients 16

Each request reranks ``--docs`` documents of about ``--doc-words`` words against one query, on ``--route``
(vLLM ``/rerank`` body by default; ``--label-token-ids`` switches to ``/generative_scoring`` for a CausalLM).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from loadgen import Connection, HttpError

WORDS = ("the capital of France is Paris and the river Seine runs through it while gravity attracts bodies "
         "towards each other and the quick brown fox jumps over the lazy dog in a small village near the sea "
         "where fishermen sell their catch every morning before the market opens").split()
QUERIES = ["What is the capital of France?", "How does gravity work?", "Where do fishermen sell fish?",
           "What does the fox jump over?"]


def make_body(rng: random.Random, docs: int, doc_words: int, label_token_ids: list[int] | None) -> dict:
    """One request body: a query and ``docs`` random documents."""
    documents = [" ".join(rng.choices(WORDS, k=doc_words)) for _ in range(docs)]
    query = rng.choice(QUERIES)
    if label_token_ids:
        return {"query": query, "items": documents, "label_token_ids": label_token_ids}
    return {"query": query, "documents": documents}


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")


def batch_counters(page: str) -> tuple[int, float]:
    """(engine calls, requests in them) from the server's /metrics page."""
    calls = re.search(r"^rerankit_batches_total (\S+)", page, re.M)
    requests = re.search(r"^rerankit_batch_requests_sum (\S+)", page, re.M)
    return (int(float(calls.group(1))), float(requests.group(1))) if calls and requests else (0, 0.0)


async def run_load(url: str, route: str, clients: int, duration: float, docs: int, doc_words: int,
                   label_token_ids: list[int] | None, warmup: int = 4) -> dict:
    """Keep ``clients`` requests in flight for ``duration`` seconds, each client on its own keep-alive connection
    (``loadgen``: one shared httpx pool, not the server, set the pace past ~32 clients); throughput, latency,
    errors."""
    latencies: list[float] = []
    errors = rejected = 0
    probe = Connection(url)
    rng = random.Random(0)
    for _ in range(warmup):
        status, _, _ = await probe.request("POST", route, make_body(rng, docs, doc_words, label_token_ids))
        if status != 200:
            raise SystemExit(f"a warm-up request was answered {status}")
    calls_before, requests_before = batch_counters((await probe.request("GET", "/metrics"))[1].decode())
    deadline = time.perf_counter() + duration

    async def one_client(seed: int) -> None:
        nonlocal errors, rejected
        client_rng, connection = random.Random(seed), Connection(url)
        while time.perf_counter() < deadline:
            body = make_body(client_rng, docs, doc_words, label_token_ids)
            begun = time.perf_counter()
            try:
                status, _, headers = await connection.request("POST", route, body)
            except (HttpError, OSError, asyncio.TimeoutError):
                status, headers = None, {}
            if status == 200:
                latencies.append(time.perf_counter() - begun)
            elif status == 429:  # the queue is full: wait as told, as a client should
                rejected += 1
                await asyncio.sleep(float(headers.get("retry-after", 1)))
            else:
                errors += 1
        connection.close()

    begun = time.perf_counter()
    await asyncio.gather(*(one_client(seed) for seed in range(1, clients + 1)))
    elapsed = time.perf_counter() - begun
    calls_after, requests_after = batch_counters((await probe.request("GET", "/metrics"))[1].decode())
    probe.close()
    calls = calls_after - calls_before
    return {
        "clients": clients, "docs_per_request": docs, "seconds": round(elapsed, 2), "requests": len(latencies),
        "errors": errors, "rejected_429": rejected, "requests_per_s": round(len(latencies) / elapsed, 2),
        "items_per_s": round(len(latencies) * docs / elapsed, 1),
        "latency_p50_ms": round(percentile(latencies, 0.50) * 1000, 2),
        "latency_p99_ms": round(percentile(latencies, 0.99) * 1000, 2),
        "mean_requests_per_engine_call": round((requests_after - requests_before) / calls, 2) if calls else None,
    }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(args: argparse.Namespace, batching: bool) -> tuple[subprocess.Popen, str]:
    """``serve(...)`` in a subprocess on a free loopback port; returns it once /health answers."""
    port = free_port()
    settings = {"batching": batching, "batch_window_ms": args.batch_window_ms, "max_batch_items": args.max_batch_items,
                "max_queue_requests": max(256, 2 * args.clients)}
    code = ("from rerankit.server.main import serve; "
            f"serve({args.model!r}, host='127.0.0.1', port={port}, device={args.device!r}, dtype={args.dtype!r}, "
            "log_level='warning', "
            f"**{settings!r})")
    src = args.server_src or str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    if args.threads:  # on a shared CPU, more torch threads than free cores make every call wait for the slowest
        env["OMP_NUM_THREADS"] = str(args.threads)
    server = subprocess.Popen([sys.executable, "-c", code], env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(server, url)
    return server, url


def wait_healthy(server: subprocess.Popen, url: str, limit_s: float = 180) -> float:
    """Seconds until the server at ``url`` answers /health; ``SystemExit`` if it exits first, or (killed) if it has
    not answered within ``limit_s``."""
    begun = time.monotonic()
    while time.monotonic() - begun < limit_s:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with status {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return time.monotonic() - begun
        except httpx.HTTPError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit(f"the server did not answer /health within {limit_s:g} s")


def measure(args: argparse.Namespace, batching: bool) -> dict:
    """Start a server for ``args.model``, load it, stop it."""
    server, url = start_server(args, batching)
    try:
        result = asyncio.run(run_load(url, args.route, args.clients, args.duration, args.docs, args.doc_words,
                                      args.label_token_ids))
    finally:
        server.terminate()
        server.wait(30)
    return {"batching": batching, **result}


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput."""
    return sorted(runs, key=lambda run: run["requests_per_s"])[len(runs) // 2]


def sweep(args: argparse.Namespace) -> None:
    """One row per client count of ``args.sweep``, against one server (``--url`` or started), printed as it ends."""
    server, url = (None, args.url) if args.url else start_server(args, not args.no_batching)
    try:
        for clients in args.sweep:
            row = asyncio.run(run_load(url, args.route, clients, args.duration, args.docs, args.doc_words,
                                       args.label_token_ids))
            print(json.dumps({"model": args.model or url, "route": args.route, **row}), flush=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server's root URL")
    target.add_argument("--model", help="start a server on this model (path; 'default' for the packaged MiniLM)")
    parser.add_argument("--server-src", default=None, help="with --model: start the server from this source tree "
                        "(another commit's, for an A/B: git archive REV src | tar -x -C DIR; then DIR/src)")
    parser.add_argument("--no-batching", action="store_true", help="server scores one request per engine call")
    parser.add_argument("--compare", action="store_true", help="with --model: run with and without batching")
    parser.add_argument("--repeats", type=int, default=1, help="with --compare: alternating runs of each")
    parser.add_argument("--threads", type=int, default=None, help="server's OMP_NUM_THREADS (torch CPU threads)")
    parser.add_argument("--device", default=None, help="server device (cpu, cuda)")
    parser.add_argument("--dtype", default=None, help="server dtype (bfloat16, fp8...; default: the engine's)")
    parser.add_argument("--batch-window-ms", type=float, default=5.0)
    parser.add_argument("--max-batch-items", type=int, default=512)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=None, help="seconds of load per run (default: 10; 15 "
                                                                       "with --cold)")
    parser.add_argument("--sweep", type=lambda text: [int(count) for count in text.split(",")], default=None,
                        help="comma-separated client counts: one row each against one server")
    parser.add_argument("--cold", action="store_true",
                        help="with --model: measure a fresh server from the moment /health answers, no warm-up")
    parser.add_argument("--docs", type=int, default=8, help="documents per request")
    parser.add_argument("--doc-words", type=int, default=40, help="words per document")
    parser.add_argument("--route", default=None, help="default: /rerank, or /generative_scoring with label ids")
    parser.add_argument("--label-token-ids", type=lambda text: [int(t) for t in text.split(",")], default=None,
                        help="comma-separated label ids: load /generative_scoring instead of /rerank")
    args = parser.parse_args()
    args.route = args.route or ("/generative_scoring" if args.label_token_ids else "/rerank")
    args.duration = args.duration or (15.0 if args.cold else 10.0)
    if args.sweep:
        args.clients = max(args.sweep)  # the started server's queue takes them all
    if args.cold and not args.model:
        parser.error("--cold needs --model: it starts its own server")
    if args.model == "default":
        from rerankit.defaults import default_model_path

        args.model = default_model_path()
    if args.sweep:
        sweep(args)
        return
    if args.cold:
        server, url = start_server(args, not args.no_batching)
        try:
            report = {"model": args.model, "route": args.route, "cold": True, **asyncio.run(run_load(
                url, args.route, args.clients, args.duration, args.docs, args.doc_words, args.label_token_ids,
                warmup=0))}
        finally:
            server.terminate()
            server.wait(30)
    elif args.url:
        report = asyncio.run(run_load(args.url, args.route, args.clients, args.duration, args.docs, args.doc_words,
                                      args.label_token_ids))
    elif args.compare:
        runs = [measure(args, batching) for _ in range(args.repeats) for batching in (True, False)]
        batched = median_run([run for run in runs if run["batching"]])
        unbatched = median_run([run for run in runs if not run["batching"]])
        report = {"model": args.model, "route": args.route, "threads": args.threads, "batching": batched,
                  "no_batching": unbatched,
                  "throughput_ratio": round(batched["requests_per_s"] / unbatched["requests_per_s"], 2),
                  "requests_per_s_all_runs": {"batching": [run["requests_per_s"] for run in runs if run["batching"]],
                                              "no_batching": [run["requests_per_s"] for run in runs
                                                              if not run["batching"]]}}
    else:
        report = {"model": args.model, "route": args.route, **measure(args, not args.no_batching)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
