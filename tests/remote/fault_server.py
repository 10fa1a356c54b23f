"""A vLLM-style server on 127.0.0.1 that misbehaves on cue, for the transport's fault and deadline tests.

Each POST takes the next fault of the server's script (then its ``default``, "ok" unless told): a reset or a close
in the middle of the body, a slow or never-ending reply, no reply until the client closes its connection ("hold":
counted in ``abandoned``), bytes dripped one at a time, a wrong or oversized body,
an HTTP status with a vLLM error body (and ``Retry-After``). "ok" answers ``/generative_scoring`` with
score = item number / 1000 ("drip-ok": the same answer, a byte at a time). ``GET /health`` answers ``health``
(a status, or "hang": no answer), counted in ``health_hits``. Each POST's headers and body are kept in ``posts``.
Other GETs (discovery probes, their paths kept in ``gets``) answer 404, or, once ``probes`` is set, its statuses
first, one a GET ("503:2": with ``Retry-After: 2``; "hang": no answer), then what vLLM publishes (``VLLM_PROBES``).
"""

from __future__ import annotations

import json
import random
import select
import socket
import struct
import threading
import time
import zlib
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_SECONDS = 1.0
# A dripping server sends one byte this often: far inside any read timeout, so only a deadline ends the reply.
DRIP_SECONDS = 0.05
HUGE_BYTES = 64 * 2**20
# Correct replies sent compressed: the client inflates them.
COMPRESSED_OK = ("gzip-ok", "deflate-ok", "raw-deflate-ok")
# How long a hanging handler waits at most (the server's stop ends it sooner).
HANG_SECONDS = 30.0
# What a vLLM server serving "fault-model" answers to the discovery probes.
VLLM_PROBES = {
    "/openapi.json": {"openapi": "3.1.0", "paths": {path: {} for path in ("/generative_scoring", "/score", "/health")}},
    "/v1/models": {"object": "list", "data": [{"id": "fault-model", "object": "model", "owned_by": "vllm"}]},
}


def items(count: int) -> list[str]:
    return [f"doc {i}" for i in range(count)]


def expected_scores(count: int) -> list[float]:
    return [i / 1000 for i in range(count)]


class FaultServer(ThreadingHTTPServer):
    """Serves the script of faults, counting hits, requests in flight and body bytes sent."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, script=(), delays=(0.0, 0.0), default: str = "ok", drip_seconds: float = DRIP_SECONDS,
                 huge_bytes: int = HUGE_BYTES) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script = deque(script)
        self.delays = delays
        self.default = default
        self.drip_seconds = drip_seconds
        self.huge_bytes = huge_bytes
        self.hits = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.sent = 0
        self.abandoned = 0  # "hold" requests whose client closed the connection
        self.health = "200"
        self.health_hits = 0
        self.probes: deque[str] | None = None  # see the module's docstring
        self.gets: list[str] = []
        self.posts: list[tuple[dict[str, str], dict]] = []  # each POST's headers (names lowercased) and body
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def next_fault(self) -> str:
        with self.lock:
            self.hits += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return self.script.popleft() if self.script else self.default

    def done(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def handle_error(self, request, client_address) -> None:
        """Broken pipes after a fault are the point of the exercise: stay quiet."""

    def stop(self) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()
        self.thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY, as uvicorn's sockets have it: the head and the body go out as two writes, and Nagle's algorithm
    # with the client's delayed ACK held each reply ~40 ms (a dripped byte still goes out alone, on its schedule).
    disable_nagle_algorithm = True
    server: FaultServer

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path != "/health":
            self._probe()
            return
        with self.server.lock:
            self.server.health_hits += 1
        if self.server.health == "hang":
            self.server.stopping.wait(HANG_SECONDS)
            self.close_connection = True
            return
        self._send_json(int(self.server.health), {})

    def _probe(self) -> None:
        with self.server.lock:
            self.server.gets.append(self.path)
            script = self.server.probes
            fault = script.popleft() if script else None
        if fault == "hang":
            self.server.stopping.wait(HANG_SECONDS)
            self.close_connection = True
        elif fault is not None:
            status, _, retry_after = fault.partition(":")
            error = {"error": {"message": f"fault {status}", "type": "Fault", "param": None, "code": int(status)}}
            self._send_json(int(status), error, {"Retry-After": retry_after} if retry_after else {})
        elif script is not None and self.path in VLLM_PROBES:
            self._send_json(200, VLLM_PROBES[self.path])
        else:
            self._send_json(404, {"error": {"message": "not found", "type": "NotFound", "param": None, "code": 404}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.posts.append(({name.lower(): value for name, value in self.headers.items()}, body))
        fault = self.server.next_fault()
        try:
            self._answer(fault, body)
        finally:
            self.server.done()

    def _answer(self, fault: str, body: dict) -> None:
        if fault in ("reset", "cut"):
            self._send_head(200, {"Content-Length": "1000"})
            self.wfile.write(b'{"data": [{"index": 0,')
            if fault == "reset":
                # SO_LINGER 0: close() sends RST, a reset in the middle of the body.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:
                self.connection.shutdown(socket.SHUT_WR)
            self.connection.close()
            self.close_connection = True
            return
        if fault == "hold":
            self._hold()
            return
        if fault == "hang":
            self.server.stopping.wait(HANG_SECONDS)
            return
        if fault == "drip":
            self._send_head(200, {"Content-Length": "100000"})
            self._drip(b"{" + b" " * 99999)
            return
        if fault == "drip-head":
            self._drip(b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10000)
            return
        if fault in ("huge", "huge-announced"):
            self._send_huge(announced=fault == "huge-announced")
            return
        if fault.endswith("-bomb"):  # huge_bytes of spaces, compressed to ~64 KB
            self._send_compressed(fault.removesuffix("-bomb"), b" " * 2**16, repeat=self.server.huge_bytes // 2**16)
            return
        if fault == "slow":
            time.sleep(SLOW_SECONDS)
        elif fault not in ("ok", "drip-ok", "nan", "inf", "dup", "missing", *COMPRESSED_OK):
            status, _, retry_after = fault.partition(":")
            error = {"error": {"message": f"fault {status}", "type": "Fault", "param": None, "code": int(status)}}
            self._send_json(int(status), error, {"Retry-After": retry_after} if retry_after else {})
            return
        time.sleep(random.uniform(*self.server.delays))
        data = [{"index": i, "object": "score", "score": int(item.split()[1]) / 1000}
                for i, item in enumerate(body["items"])]
        if fault in ("nan", "inf"):
            data[-1]["score"] = float(fault)
        elif fault == "dup":
            data[-1]["index"] = 0
        elif fault == "missing":
            data.pop()
        payload = {"id": "x", "object": "list", "created": 0, "model": "fault-model", "data": data,
                   "usage": {"prompt_tokens": len(data), "total_tokens": len(data)}}
        if fault in COMPRESSED_OK:
            self._send_compressed(fault.removesuffix("-ok"), json.dumps(payload).encode())
            return
        if fault == "drip-ok":
            raw = json.dumps(payload, separators=(",", ":")).encode()
            self._send_head(200, {"Content-Length": str(len(raw))})
            self._drip(raw)
            return
        self._send_json(200, payload)

    def _hold(self) -> None:
        """Answer nothing; return once the client has closed the connection (counted) or the server stops."""
        self.close_connection = True
        while not self.server.stopping.is_set():
            readable, _, _ = select.select([self.connection], [], [], 0.02)
            if readable and not self.connection.recv(1, socket.MSG_PEEK):
                with self.server.lock:
                    self.server.abandoned += 1
                return

    def _drip(self, raw: bytes) -> None:
        for byte in raw:
            if self.server.stopping.wait(self.server.drip_seconds):
                break
            self.wfile.write(bytes([byte]))
        self.close_connection = True

    def _send_huge(self, announced: bool) -> None:
        """A body of ``huge_bytes`` (spaces), with its length announced or delimited by closing."""
        size = self.server.huge_bytes
        self._send_head(200, {"Content-Length": str(size)} if announced else {"Connection": "close"})
        self.close_connection = True
        chunk = b" " * 2**16
        for _ in range(size // len(chunk)):
            self.wfile.write(chunk)
            with self.server.lock:
                self.server.sent += len(chunk)

    def _send_compressed(self, coding: str, raw: bytes, repeat: int = 1) -> None:
        """``raw`` ``repeat`` times over, sent as ``coding``: gzip, deflate (zlib-wrapped), raw-deflate (sent as
        deflate) or zstd (which the client never asks for: its bytes need not be valid). Compressed piece by piece,
        so that a bomb's inflated size is never held here."""
        if coding == "zstd":
            data = b"\x28\xb5\x2f\xfd" + raw[:64]
        else:
            wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS, "raw-deflate": -zlib.MAX_WBITS}[coding]
            packer = zlib.compressobj(9, zlib.DEFLATED, wbits)
            data = b"".join(packer.compress(raw) for _ in range(repeat)) + packer.flush()
            coding = "gzip" if coding == "gzip" else "deflate"
        self._send_head(200, {"Content-Length": str(len(data)), "Content-Encoding": coding})
        self.wfile.write(data)

    def _send_head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def _send_json(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
        raw = json.dumps(payload).encode()
        self._send_head(status, {"Content-Length": str(len(raw)), **(headers or {})})
        self.wfile.write(raw)
