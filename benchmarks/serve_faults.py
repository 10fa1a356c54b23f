"""Faults against ``rerankit serve`` (issue 20, rows 1, 2 and 4): clients that hang up, a large request in front
of a small one, SIGTERM under load. Each row starts its own server (a subprocess on the packaged MiniLM, or
``--model``) and prints one JSON line.

    python benchmarks/serve_faults.py                       # every row, this checkout's code
    python benchmarks/serve_faults.py --src /tmp/before/src  # the same against another checkout (the "before")
    python benchmarks/serve_faults.py --rows 2 --serve '{"max_request_tokens": 1048576}'

Row 1: the idle latency of a request; then ``--hangups`` clients send a full body and close their sockets at once;
then the same request again: its latency. Row 2: the idle latency of a 2-doc request; then one ``/v2/rerank`` of
``--big-docs`` documents of ~4 KB, and the 2-doc request 1 s later: its latency (the large one is hung up once the
small one is answered, unless ``--wait-big``). Row 4: ``--inflight`` clients in flight, SIGTERM 1 s later: how many
got 200, a JSON 503, anything else (a plain-text 500, a dropped connection).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from serve_load import free_port, wait_healthy

SENTENCE = "the river runs through the old town where the market opens every morning before dawn and "
QUERY = "where does the market open"


def docs(count: int, size: int) -> list[str]:
    return [(f"document {n}: " + SENTENCE * (size // len(SENTENCE) + 1))[:size] for n in range(count)]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """``serve()`` of the code under ``args.src`` in a subprocess; returns once /health answers."""
    port = free_port()
    settings = json.loads(args.serve)
    code = (f"from rerankit.server.main import serve; serve({args.model!r}, port={port}, device='cpu', "
            f"log_level='warning', **{settings!r})")
    env = {**os.environ, "PYTHONPATH": args.src, "OMP_NUM_THREADS": str(args.threads)}
    server = subprocess.Popen([sys.executable, "-c", code], env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(server, url)
    return server, url


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.kill()
        server.wait(30)


async def timed_post(client: httpx.AsyncClient, route: str, body: dict) -> tuple[float, int]:
    begun = time.perf_counter()
    reply = await client.post(route, json=body)
    return time.perf_counter() - begun, reply.status_code


def hang_up(url: str, route: str, body: dict) -> None:
    """Send a whole request over a plain socket and close it without reading the answer."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(f"POST {route} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)


async def row_hangups(url: str, args: argparse.Namespace) -> dict:
    body = {"query": QUERY, "documents": docs(args.docs, 1000)}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await timed_post(client, "/rerank", body)  # warm
        idle, _ = await timed_post(client, "/rerank", body)
        for _ in range(args.hangups):
            hang_up(url, "/rerank", body)
        after, status = await timed_post(client, "/rerank", body)
        metrics = (await client.get("/metrics")).text
    cancelled = next((line.split()[-1] for line in metrics.splitlines()
                      if line.startswith("rerankit_cancelled_total")), None)
    return {"row": 1, "probe": f"{args.hangups} clients send {args.docs} docs x 1 KB and hang up; then one request",
            "idle_s": round(idle, 3), "after_hangups_s": round(after, 3), "status": status,
            "ratio_to_idle": round(after / idle, 2), "cancelled_counted": cancelled}


async def row_large_then_small(url: str, args: argparse.Namespace) -> dict:
    small = {"query": QUERY, "documents": docs(2, 4000)}
    big = {"query": QUERY, "documents": docs(args.big_docs, 4000)}
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        await timed_post(client, "/v2/rerank", small)  # warm
        idle, _ = await timed_post(client, "/v2/rerank", small)
        big_task = asyncio.create_task(timed_post(client, "/v2/rerank", big))
        await asyncio.sleep(1)
        waited, status = await timed_post(client, "/v2/rerank", small)
        row = {"row": 2, "probe": f"1 x {args.big_docs} docs x 4 KB, then a 2-doc request 1 s later",
               "small_idle_s": round(idle, 3), "small_behind_big_s": round(waited, 3), "small_status": status,
               "ratio_to_idle": round(waited / idle, 2)}
        if args.wait_big:
            big_s, big_status = await big_task
            row.update(big_s=round(big_s, 2), big_status=big_status)
        else:
            big_task.cancel()
            await asyncio.gather(big_task, return_exceptions=True)
    return row


async def row_sigterm(url: str, server: subprocess.Popen, args: argparse.Namespace) -> dict:
    body = {"query": QUERY, "documents": docs(args.docs, 1000)}
    limits = httpx.Limits(max_connections=args.inflight)
    counts = {"200": 0, "json_503": 0, "other": 0}
    others: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        sent = [asyncio.create_task(client.post("/rerank", json=body)) for _ in range(args.inflight)]
        await asyncio.sleep(1)
        server.send_signal(signal.SIGTERM)
        begun = time.perf_counter()
        replies = await asyncio.gather(*sent, return_exceptions=True)
    for reply in replies:
        if isinstance(reply, httpx.Response) and reply.status_code == 200:
            counts["200"] += 1
        elif isinstance(reply, httpx.Response) and reply.status_code == 503 and _is_json(reply):
            counts["json_503"] += 1
        else:
            counts["other"] += 1
            others.append(repr(reply) if not isinstance(reply, httpx.Response) else f"{reply.status_code} "
                          f"{reply.headers.get('content-type')}")
    server.wait(120)
    return {"row": 4, "probe": f"SIGTERM with {args.inflight} clients in flight ({args.docs} docs x 1 KB each)",
            **counts, "others": sorted(set(others))[:5], "answered_within_s": round(time.perf_counter() - begun, 2),
            "exit_status": server.returncode}


def _is_json(reply: httpx.Response) -> bool:
    try:
        reply.json()
    except ValueError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"),
                        help="the rerankit source folder the server runs (default: this checkout's)")
    parser.add_argument("--model", default=None, help="model path (default: the packaged MiniLM)")
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--serve", default="{}", help="ServerConfig settings as JSON, e.g. '{\"drain_seconds\": 5}'")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the server")
    parser.add_argument("--docs", type=int, default=20, help="documents per request in rows 1 and 4")
    parser.add_argument("--hangups", type=int, default=100)
    parser.add_argument("--big-docs", type=int, default=1000)
    parser.add_argument("--wait-big", action="store_true", help="row 2: also wait for the large request")
    parser.add_argument("--inflight", type=int, default=64)
    args = parser.parse_args()
    for row in args.rows.split(","):
        server, url = start_server(args)
        try:
            if row == "1":
                result = asyncio.run(row_hangups(url, args))
            elif row == "2":
                result = asyncio.run(row_large_then_small(url, args))
            elif row == "4":
                result = asyncio.run(row_sigterm(url, server, args))
            else:
                raise SystemExit(f"no row {row}: rows 1, 2 and 4")
        finally:
            stop_server(server)
        print(json.dumps({"src": args.src, **result}), flush=True)


if __name__ == "__main__":
    main()
