"""Clients that stall, and SIGTERM: a body still arriving when the drain starts is answered 503 (not
cancelled by uvicorn into a plain-text 500); a client that stops reading its answer is dropped and frees its slot;
SIGTERM ends the process only after serve() has closed the backend."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
from live_server import held_until, live_server
from server_fakes import RecordingBackend

from rerankit.server.app import create_app
from rerankit.server.limits import ServerConfig


def test_a_body_still_arriving_when_the_drain_starts_is_answered_503_json():
    config = ServerConfig(warm_up=False, body_timeout_s=30)
    app = create_app(RecordingBackend(), config)
    batcher = app.state.batcher
    with live_server(app, config) as base:
        port = int(base.rsplit(":", 1)[1])
        body = json.dumps({"query": "q", "documents": ["a", "b"]}).encode()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /rerank HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])  # the rest never comes
        time.sleep(0.3)
        started = time.monotonic()
        asyncio.run_coroutine_threadsafe(batcher.drain(5), batcher._dispatcher.get_loop())  # what SIGTERM starts
        sock.settimeout(5)
        answer = sock.recv(65536).decode()
        assert answer.startswith("HTTP/1.1 503"), answer
        assert "application/json" in answer and "shutting" in answer
        assert time.monotonic() - started < 2
        sock.close()


def test_a_client_that_stops_reading_its_answer_is_dropped_and_frees_its_connection_slot():
    config = ServerConfig(warm_up=False, header_timeout_s=0.5, keep_alive_timeout_s=0.2, max_connections=2,
                          max_body_bytes=16 * 1024 * 1024, max_request_tokens=10 ** 8)
    with live_server(create_app(RecordingBackend(), config), config) as base:
        port = int(base.rsplit(":", 1)[1])
        # an answer far larger than the kernel's socket buffers: the rest waits in the server's write buffer
        doc = "x" * 12000
        body = json.dumps({"query": "q", "documents": [doc] * 1000, "return_documents": True}).encode()
        stalled = []
        for _ in range(2):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"POST /v2/rerank HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            assert sock.recv(64).startswith(b"HTTP/1.1 200")  # answered; never read further
            stalled.append(sock)
        # keep-alive closes them (a close that waits for the unsent answer), header deadlines pass: waited for until
        # the server lets both sockets go (at most the 2.5 s this waited before), where /proc tells it
        if Path("/proc/net/tcp").exists():
            held_until(port, 0, within_s=2.5)
        else:
            time.sleep(2.5)
        answer = httpx.post(base + "/rerank", json={"query": "q", "documents": ["a"]}, timeout=5)
        assert answer.status_code == 200, answer.text
        for sock in stalled:
            sock.close()


def test_sigterm_ends_serve_only_after_the_backend_is_closed(tmp_path):
    """uvicorn raises SIGTERM again as it ends, with the default handler back: the process died before serve()
    closed the backend (data-parallel replicas outlived it) and sent its last spans. It still dies of SIGTERM."""
    import os
    import signal
    import subprocess
    import sys

    from live_server import wait_until_healthy

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    marker = tmp_path / "closed"
    code = f"""
import rerankit.reranker
from server_fakes import RecordingBackend

class Closing(RecordingBackend):
    def close(self):
        open({str(marker)!r}, "w").write("closed")

rerankit.reranker.make_backend = lambda *args, **kwargs: Closing()
from rerankit.server.main import serve
serve("recording", port={port}, warm_up=False)
"""
    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), str(tests)])}
    server = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(server, f"http://127.0.0.1:{port}")
    finally:
        server.send_signal(signal.SIGTERM)
        _, log = server.communicate(timeout=30)
    assert server.returncode == -signal.SIGTERM, log
    assert marker.read_text() == "closed", log
