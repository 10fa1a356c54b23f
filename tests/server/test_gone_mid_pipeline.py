"""A client that pipelines requests on one connection and goes while the first is still being scored: every request
of the connection is a client that left. The running one is cancelled (its engine call stops before its next
micro-batch), those sent behind it never run, nothing is written to the closed connection and nothing is logged.

uvicorn marks only its newest request as disconnected: with httptools that is the last one parsed, queued behind
the one running. A client that closes (not a reset) sends the same end of the stream as one that only closed its
side: what it sent before is answered in turn (``test_half_close.py``) until the server learns otherwise, when an
answer written meets the client's reset. Real uvicorn servers on loopback, each HTTP protocol on each loop; the
backend holds each engine call until the test lets it through, asking ``should_stop`` as the engine does."""

from __future__ import annotations

import json
import queue
import socket
import struct
import threading
from contextlib import ExitStack
from typing import Any

import pytest
from live_server import live_server
from server_fakes import RecordingBackend
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rerankit.errors import Cancelled
from rerankit.server.app import create_app
from rerankit.server.limits import ServerConfig

# Long timeouts: nothing here is closed by a timer. A wait that runs out is a failure, never the way a test passes.
CONFIG = ServerConfig(warm_up=False, batch_window_ms=1, header_timeout_s=30, body_timeout_s=30,
                      keep_alive_timeout_s=30)
WAIT_S = 5
MODELS = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Name: models\r\n\r\n"


def scoring(name: str) -> bytes:
    """A POST /v1/rerank whose query, and ``X-Name``, is ``name``."""
    body = json.dumps({"query": name, "documents": ["a", "bb"]}).encode()
    return (b"POST /v1/rerank HTTP/1.1\r\nHost: x\r\nX-Name: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (name.encode(), len(body), body))


class HeldBackend(RecordingBackend):
    """Holds each engine call until ``let_one_through``; asks ``should_stop`` meanwhile, as the engine does between
    micro-batches, and stops the call when it says so. Each call is one request here (one at a time)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered: queue.Queue[str] = queue.Queue()
        self.stopped: queue.Queue[str] = queue.Queue()
        self.finished: list[str] = []
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()  # set once the server has stopped: nothing is held any longer

    def let_one_through(self) -> None:
        self._permits.release()

    def open(self) -> None:
        self._open.set()

    def score_batch(self, requests, *, return_exceptions=False, should_stop=None):
        queries = [request.query for request in requests]
        self.calls.append(queries)
        self.entered.put(queries[0])
        while not self._open.is_set() and not self._permits.acquire(timeout=0.005):
            if should_stop is not None and should_stop():
                self.stopped.put(queries[0])
                raise Cancelled("stopped")
        self.finished.append(queries[0])
        return [self._respond(request) for request in requests]


class Spy:
    """The app, recording the requests it is called for (by ``X-Name``) and, as each returns, whether each message it
    sent was written: uvicorn writes nothing for a request it has marked disconnected."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.called: list[str] = []
        self.returned: queue.Queue[tuple[str, list[bool]]] = queue.Queue()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name = dict(scope["headers"]).get(b"x-name", b"").decode()
        self.called.append(name)
        cycle = send.__self__  # uvicorn's request cycle: the app's send is its bound method
        written: list[bool] = []

        async def watched(message) -> None:
            written.append(not cycle.disconnected)
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self.returned.put((name, written))


class Served:
    """A server of ``HeldBackend`` behind ``Spy`` until ``stop()`` (then the backend lets every call through)."""

    def __init__(self, protocol: type, loop: str) -> None:
        self.backend = HeldBackend()
        self.spy = Spy(create_app(self.backend, CONFIG))
        self._stack = ExitStack()
        url = self._stack.enter_context(live_server(self.spy, CONFIG, protocol=protocol, loop=loop))
        self._stack.callback(self.backend.open)  # after the server has stopped: a call still held would hang
        self.port = int(url.rsplit(":", 1)[1])

    def stop(self) -> None:
        """Stop the server (it waits for its requests): what follows sees everything they did and logged."""
        self._stack.close()


@pytest.fixture(params=[(HttpToolsProtocol, "asyncio"), (HttpToolsProtocol, "uvloop"), (H11Protocol, "asyncio"),
                        (H11Protocol, "uvloop")], ids=["httptools-asyncio", "httptools-uvloop", "h11-asyncio",
                                                       "h11-uvloop"])
def served(request):
    protocol, loop = request.param
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    server = Served(protocol, loop)
    yield server
    server.stop()


def next_of(items: queue.Queue, what: str) -> Any:
    """The next of ``items``, which is due at once; fails the test with ``what`` if none comes."""
    try:
        return items.get(timeout=WAIT_S)
    except queue.Empty:
        pytest.fail(f"{what} did not happen")


def reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (RST), as a client killed or timing out with SO_LINGER 0 does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def read_answer(sock: socket.socket) -> bytes:
    """The status line of the next whole answer on ``sock`` (each has a Content-Length)."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, received
        body += chunk
    return lines[0]


def test_a_reset_mid_pipeline_cancels_the_running_request_and_drops_those_behind_it(served, errors):
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=WAIT_S)
    sock.sendall(scoring("A") + scoring("B") + MODELS)
    assert next_of(served.backend.entered, "the first engine call") == "A"
    reset(sock)
    assert next_of(served.backend.stopped, "the running request's cancel") == "A"
    assert next_of(served.spy.returned, "the first request's end") == ("A", [False, False])  # nothing written
    served.stop()
    assert served.spy.called == ["A"] and served.backend.calls == [["A"]] and not served.backend.finished
    assert not errors, errors


def test_a_reset_after_the_end_of_the_stream_cancels_the_request_then_running(served, errors):
    """The end of the stream is no sign that the client left: what it sent before is answered in turn. A reset
    that comes later (a client that closed, not half-closed, resets the connection when the first answer reaches
    it) is: the request then running is cancelled and the one behind it never runs. Neither loop reads a socket
    after its end of the stream, so the reset is looked for apart."""
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=WAIT_S)
    sock.sendall(scoring("A") + scoring("B") + scoring("C"))
    assert next_of(served.backend.entered, "the first engine call") == "A"
    sock.shutdown(socket.SHUT_WR)
    served.backend.let_one_through()
    assert read_answer(sock) == b"HTTP/1.1 200 OK"
    assert next_of(served.backend.entered, "the second engine call") == "B"
    reset(sock)
    assert next_of(served.backend.stopped, "the running request's cancel") == "B"
    assert next_of(served.spy.returned, "the first request's end") == ("A", [True, True])
    assert next_of(served.spy.returned, "the second request's end") == ("B", [False, False])
    served.stop()
    assert served.spy.called == ["A", "B"] and served.backend.finished == ["A"]
    assert not errors, errors


def test_a_close_mid_pipeline_is_answered_as_a_half_close_until_the_answer_meets_its_reset(served, errors):
    """The server cannot tell a close from a half-close: the running request is answered. Its answer meets the
    client's reset; the scoring request behind it is never scored, and nothing is logged."""
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=WAIT_S)
    sock.sendall(scoring("A") + scoring("B"))
    assert next_of(served.backend.entered, "the first engine call") == "A"
    sock.close()
    served.backend.let_one_through()
    served.stop()
    returned = dict(served.spy.returned.get_nowait() for _ in range(served.spy.returned.qsize()))
    assert returned["A"] == [True, True] and served.backend.finished == ["A"]
    assert not any(returned.get("B", ())), "an answer was written after the reset"
    assert not errors, errors
