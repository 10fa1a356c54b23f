"""Fair shares between callers under a flood: an indexing tenant keeps many large requests in flight while a search
tenant sends small ones; the search tenant's latency with the server told who is who (``--caller-header``, one
share a tenant) beside the same load on a server that sees one caller (one share a request), alternating runs::

    PYTHONPATH=src python benchmarks/tenants.py --model default --duration 15 --threads 1

Prints a JSON line per run and one with the medians and the ratio of the search tenant's p50 and p99 latency.
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadgen import Connection, HttpError  # noqa: E402
from serve_load import free_port, make_body, percentile, wait_healthy  # noqa: E402

HEADER = "X-Tenant"


def start(args: argparse.Namespace, fair: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    settings = {"caller_header": HEADER if fair else None, "max_queue_requests": 4 * (args.flood + args.search)}
    model = None if args.model == "default" else args.model
    code = ("from rerankit.server.main import serve; "
            f"serve({model!r}, host='127.0.0.1', port={port}, device={args.device!r}, log_level='warning', "
            f"**{settings!r})")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    server = subprocess.Popen([sys.executable, "-c", code], env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(server, url)
    return server, url


async def load(url: str, args: argparse.Namespace) -> dict:
    """Both tenants' closed-loop clients for ``args.duration`` seconds (after ``args.warmup``)."""
    latencies: dict[str, list[float]] = {"indexer": [], "search": []}
    items = {"indexer": 0, "search": 0}
    errors = 0
    begun = time.perf_counter()
    measured_from, deadline = begun + args.warmup, begun + args.warmup + args.duration

    async def client(tenant: str, docs: int, seed: int) -> None:
        nonlocal errors
        rng, connection = random.Random(seed), Connection(url)
        while time.perf_counter() < deadline:
            body = make_body(rng, docs, args.doc_words, None)
            sent = time.perf_counter()
            try:
                status, _, _ = await connection.request("POST", "/rerank", body, {HEADER: tenant})
            except (HttpError, OSError, asyncio.TimeoutError):
                status = None
            if status != 200:
                errors += 1
                await asyncio.sleep(0.1)
            elif sent >= measured_from:
                latencies[tenant].append(time.perf_counter() - sent)
                items[tenant] += docs
        connection.close()

    await asyncio.gather(*(client("indexer", args.flood_docs, seed) for seed in range(args.flood)),
                         *(client("search", args.search_docs, 1000 + seed) for seed in range(args.search)))
    row: dict = {"errors": errors}
    for tenant, values in latencies.items():
        row[tenant] = {"requests": len(values), "items_per_s": round(items[tenant] / args.duration, 1),
                       "p50_ms": round(percentile(values, 0.5) * 1000, 1),
                       "p99_ms": round(percentile(values, 0.99) * 1000, 1)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="model path ('default': the packaged MiniLM)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="the server's OMP_NUM_THREADS")
    parser.add_argument("--flood", type=int, default=32, help="the indexing tenant's clients")
    parser.add_argument("--flood-docs", type=int, default=64, help="documents of each indexing request")
    parser.add_argument("--search", type=int, default=4, help="the search tenant's clients")
    parser.add_argument("--search-docs", type=int, default=4, help="documents of each search request")
    parser.add_argument("--doc-words", type=int, default=40)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before measuring")
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of each server")
    args = parser.parse_args()
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.repeats):
        for fair in (False, True):
            server, url = start(args, fair)
            try:
                row = asyncio.run(load(url, args))
            finally:
                server.terminate()
                server.wait(30)
            runs[fair].append(row)
            print(json.dumps({"shares": "per tenant" if fair else "per request", **row}), flush=True)
    summary = {}
    for fair, rows in runs.items():
        key = "per_tenant" if fair else "per_request"
        summary[key] = {stat: statistics.median(row["search"][stat] for row in rows) for stat in ("p50_ms", "p99_ms")}
        summary[key]["indexer_items_per_s"] = statistics.median(row["indexer"]["items_per_s"] for row in rows)
    summary["search_p99_ratio"] = round(summary["per_request"]["p99_ms"] / summary["per_tenant"]["p99_ms"], 2)
    summary["search_p50_ratio"] = round(summary["per_request"]["p50_ms"] / summary["per_tenant"]["p50_ms"], 2)
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
