"""A client that closes its side of the connection (``shutdown(SHUT_WR)``, as ``nc -N`` and some health checkers
do) once its request is sent gets its answer, however long it takes, then the connection closes (an answer begun
after that end says ``Connection: close``); a request still incomplete at that end is dropped quietly. On the
scoring routes the end of the stream still means that the client left: its work is cancelled
(``test_scheduler_http.py``). On a real uvicorn on loopback, with each of its HTTP protocols."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import pytest
from live_server import live_server
from server_fakes import RecordingBackend
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rerankit.server.app import create_app
from rerankit.server.limits import ServerConfig

# Long timeouts: a connection closed within a second was closed for the end of its stream, not by a timer.
CONFIG = ServerConfig(warm_up=False, header_timeout_s=30, body_timeout_s=30, keep_alive_timeout_s=30)
BODY = json.dumps({"query": "q", "documents": ["a", "bb"]}).encode()
HEAD = (b"POST /rerank HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % len(BODY))


class SlowHealth:
    """The app, whose ``/health`` takes a moment, as a proxy's does (it asks the far server)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/health":
            await asyncio.sleep(0.2)
        await self.app(scope, receive, send)


@pytest.fixture(scope="module", params=[HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def base(request):
    backend = RecordingBackend()
    with live_server(SlowHealth(create_app(backend, CONFIG)), CONFIG, protocol=request.param) as url:
        yield url, backend


@pytest.fixture
def errors():
    """Records of warning and above from the server's loggers (uvicorn's do not reach the root logger)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "uvicorn", "rerankit", "asyncio", "")]
    for logger in loggers:
        logger.addHandler(handler)
    yield records
    for logger in loggers:
        logger.removeHandler(handler)


def half_closed(base: str, sent: bytes) -> tuple[bytes, float]:
    """What the server sends back to a client that sends ``sent`` then closes its side, and how long until it
    closes the connection."""
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(sent)
        sock.shutdown(socket.SHUT_WR)
        started, received = time.monotonic(), b""
        while chunk := sock.recv(65536):
            received += chunk
    return received, time.monotonic() - started


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/metrics"])
def test_a_whole_request_then_the_end_of_the_stream_is_answered_then_closed(base, errors, path):
    url, _ = base
    answer, took = half_closed(url, b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
    assert answer.startswith(b"HTTP/1.1 200") and b"\r\n\r\n" in answer, answer
    assert took < 5 and not errors


@pytest.mark.parametrize("sent", [b"", HEAD[:20], HEAD + BODY[:5]], ids=["nothing", "part-head", "part-body"])
def test_an_incomplete_request_at_the_end_of_the_stream_is_dropped_quietly(base, errors, sent):
    url, backend = base
    calls = len(backend.calls)
    answer, took = half_closed(url, sent)
    time.sleep(0.1)  # an error the dropped request would log
    assert answer == b"" and took < 5 and not errors, errors
    assert len(backend.calls) == calls


def test_an_answer_begun_after_the_end_of_the_stream_says_the_connection_closes(base, errors):
    """The server closes the connection once it has answered (RFC 9112 section 9.6: it says so with
    ``Connection: close``). ``/health`` takes 0.2 s here, so the end of the stream comes before the answer begins.
    uvicorn's httptools protocol writes the header for the close it is told of; its h11 protocol does not by itself,
    and neither may write it twice."""
    url, _ = base
    answer, took = half_closed(url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    fields = [line.lower().replace(b" ", b"") for line in head.split(b"\r\n")[1:]]
    assert head.startswith(b"HTTP/1.1 200") and body == b'{"status":"ok"}', answer
    assert fields.count(b"connection:close") == 1, head
    assert took < 5 and not errors
