"""The transport against real sockets on 127.0.0.1: a vLLM-style server that misbehaves on cue.

Each POST takes the next fault of the server's script (then answers normally): connection reset mid-response,
a reply slower than the read timeout, an HTTP status with a vLLM error body (and ``Retry-After``).
"""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rerankit.errors import RemoteError
from rerankit.remote import RemoteBackend, Timeout
from rerankit.schema import ScoreRequest

SLOW_SECONDS = 0.6
READ_TIMEOUT = 0.2
FAST = {"timeout": Timeout(connect=0.5, read=READ_TIMEOUT), "backoff_base": 0.01, "backoff_max": 2.0}


def items(count: int) -> list[str]:
    return [f"doc {i}" for i in range(count)]


def expected_scores(count: int) -> list[float]:
    return [i / 1000 for i in range(count)]


class FaultServer(ThreadingHTTPServer):
    """Answers ``/generative_scoring`` with score = item number / 1000, after the scripted faults."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, script=(), delays=(0.0, 0.0)) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script = deque(script)
        self.delays = delays
        self.hits = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
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
            return self.script.popleft() if self.script else "ok"

    def done(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def handle_error(self, request, client_address) -> None:
        """Broken pipes after a fault are the point of the exercise: stay quiet."""

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FaultServer

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        fault = self.server.next_fault()
        try:
            self._answer(fault, body)
        finally:
            self.server.done()

    def _answer(self, fault: str, body: dict) -> None:
        if fault == "reset":
            self._send_head(200, {"Content-Length": "1000"})
            self.wfile.write(b'{"data": [{"index": 0,')
            # SO_LINGER 0: close() sends RST, a reset in the middle of the body.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        if fault == "slow":
            time.sleep(SLOW_SECONDS)
        elif fault != "ok":
            status, _, retry_after = fault.partition(":")
            error = {"error": {"message": f"fault {status}", "type": "Fault", "param": None, "code": int(status)}}
            self._send_json(int(status), error, {"Retry-After": retry_after} if retry_after else {})
            return
        time.sleep(random.uniform(*self.server.delays))
        data = [{"index": i, "object": "score", "score": int(item.split()[1]) / 1000}
                for i, item in enumerate(body["items"])]
        self._send_json(200, {"id": "x", "object": "list", "created": 0, "model": "fault-model", "data": data,
                              "usage": {"prompt_tokens": len(data), "total_tokens": len(data)}})

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


@pytest.fixture
def servers():
    """Starts fault servers on demand; stops them all at the end."""
    started: list[FaultServer] = []

    def start(script=(), delays=(0.0, 0.0)) -> FaultServer:
        server = FaultServer(script, delays)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def dead_url() -> str:
    """A loopback URL where nothing listens: connections are refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def score(urls, count: int = 3, **options):
    options = {**FAST, "dialect": "vllm-generative", **options}
    with RemoteBackend(urls, **options) as remote:
        return remote.score(ScoreRequest(query="q", items=items(count), label_token_ids=[1, 2]))


def test_connection_refused_is_retried_then_raises(dead_url):
    started = time.monotonic()
    with pytest.raises(RemoteError, match=r"ConnectError.*3 tries"):
        score(dead_url, max_retries=2)
    assert time.monotonic() - started < 2.0


def test_connection_reset_mid_response_is_retried(servers):
    server = servers(["reset"])
    assert score(server.url).scores == expected_scores(3)
    assert server.hits == 2


def test_read_timeout_is_retried(servers):
    server = servers(["slow"])
    assert score(server.url).scores == expected_scores(3)
    assert server.hits == 2


def test_read_timeout_without_retries_raises(servers):
    server = servers(["slow"])
    with pytest.raises(RemoteError, match=r"no complete answer within 0.2 s"):
        score(server.url, max_retries=0)
    assert server.hits == 1


def test_429_waits_for_retry_after(servers):
    server = servers(["429:1"])
    started = time.monotonic()
    assert score(server.url).scores == expected_scores(3)
    assert time.monotonic() - started >= 0.95
    assert server.hits == 2


def test_503_then_success(servers):
    server = servers(["503", "503"])
    assert score(server.url).scores == expected_scores(3)
    assert server.hits == 3


def test_5xx_past_the_retry_budget_raises_with_the_status(servers):
    server = servers(["503"] * 5)
    with pytest.raises(RemoteError, match="fault 503") as failed:
        score(server.url, max_retries=2)
    assert failed.value.status_code == 503 and server.hits == 3


def test_400_is_not_retried(servers):
    server = servers(["400"])
    with pytest.raises(RemoteError, match="fault 400") as failed:
        score(server.url)
    assert failed.value.status_code == 400 and server.hits == 1


def test_dead_endpoint_is_skipped_and_results_stay_complete_and_ordered(servers, dead_url):
    live = servers()
    started = time.monotonic()
    response = score([dead_url, live.url], count=10, max_items_per_request=2, max_retries=1)
    assert response.scores == expected_scores(10)
    assert live.hits == 5
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("use_async", [False, True])
async def test_split_requests_run_concurrently_and_reassemble_in_order(servers, use_async):
    server = servers(delays=(0.05, 0.12))
    options = {**FAST, "timeout": Timeout(connect=0.5, read=2.0), "dialect": "vllm-generative",
               "max_items_per_request": 4, "max_concurrency": 3}
    request = ScoreRequest(query="q", items=items(23), label_token_ids=[1, 2])
    remote = RemoteBackend(server.url, **options)
    response = await remote.ascore(request) if use_async else remote.score(request)
    await remote.aclose()
    assert response.scores == expected_scores(23)
    assert response.usage.prompt_tokens == 23
    assert server.hits == 6
    assert 2 <= server.max_in_flight <= 3


async def test_async_fails_over_and_retries(servers, dead_url):
    live = servers(["503"])
    remote = RemoteBackend([dead_url, live.url], **FAST, dialect="vllm-generative")
    response = await remote.ascore(ScoreRequest(query="q", items=items(4), label_token_ids=[1]))
    await remote.aclose()
    assert response.scores == expected_scores(4)
    assert live.hits == 2


def test_failover_is_immediate_but_a_full_round_of_failures_backs_off(servers):
    first, second = servers(["503", "503"]), servers(["503"])
    started = time.monotonic()
    response = score([first.url, second.url], max_retries=3, backoff_base=0.2)
    elapsed = time.monotonic() - started
    assert response.scores == expected_scores(3)
    assert (first.hits, second.hits) == (2, 2)
    # first -> second at once; then two backoffs: retry 2 waits >= 0.2 s, retry 3 >= 0.4 s.
    assert 0.6 <= elapsed < 2.0
