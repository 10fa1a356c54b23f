"""A client that closes its side of the connection (``shutdown(SHUT_WR)``, as ``nc -N`` and some health checkers
do) once its request is sent gets its answer, however long it takes, then the connection closes (an answer begun
after that end says ``Connection: close``); a request still incomplete at that end is dropped quietly. On the
scoring routes the end of the stream still means that the client left: its work is cancelled
(``test_scheduler_http.py``). Requests pipelined before that end are each answered in turn, the end applying to
the last of them. On a real uvicorn on loopback, with each of its HTTP protocols."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from live_server import live_server
from server_fakes import RecordingBackend
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rerankit.server.app import create_app
from rerankit.server.limits import ServerConfig
from rerankit.server.routes import ROUTES

# Long timeouts: a connection closed within a second was closed for the end of its stream, not by a timer.
CONFIG = ServerConfig(warm_up=False, header_timeout_s=30, body_timeout_s=30, keep_alive_timeout_s=30)
BODY = json.dumps({"query": "q", "documents": ["a", "bb"]}).encode()
HEAD = (b"POST /rerank HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % len(BODY))
ECHO = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\necho"
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
MODELS = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
PAUSE_S = 0.2  # long enough for the end of the stream to arrive while an answer is pending


class Slowed:
    """The app, whose ``/health`` takes a moment, as a proxy's does (it asks the far server), and whose scoring
    answers begin a moment late; plus ``POST /echo``, a route that is not a scoring one, reads its body and answers
    it a moment later. Each reads what it reads of its request, then the end of the stream comes before it answers."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif scope["path"] == "/echo":
            body, more = b"", True
            while more:
                message = await receive()
                body, more = body + message.get("body", b""), message.get("more_body", False)
            await asyncio.sleep(PAUSE_S)
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
            await send({"type": "http.response.body", "body": body})
        elif scope["path"] in ROUTES:
            async def later(message) -> None:
                if message["type"] == "http.response.start":
                    await asyncio.sleep(PAUSE_S)
                await send(message)

            await self.app(scope, receive, later)
        else:
            if scope["path"] == "/health":
                await asyncio.sleep(PAUSE_S)
            await self.app(scope, receive, send)


@pytest.fixture(scope="module", params=[HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def base(request):
    backend = RecordingBackend()
    with live_server(Slowed(create_app(backend, CONFIG)), CONFIG, protocol=request.param) as url:
        yield url, backend


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


def _answers(received: bytes) -> list[tuple[bytes, bytes]]:
    """The status lines and bodies of the answers in ``received`` (each with a Content-Length)."""
    answers = []
    while received:
        head, _, rest = received.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length:"))
        answers.append((lines[0], rest[:length]))
        received = rest[length:]
    return answers


@pytest.mark.parametrize("first", [ECHO, HEAD + BODY], ids=["echo", "scoring"])
def test_requests_pipelined_before_the_end_of_the_stream_are_each_answered_then_closed(base, errors, first):
    """RFC 9112 section 9.3: each whole request received before the client's end of the stream is answered, in
    order. A first request that reads its body lets the server read on, so the end may come while it is answered
    and the second still waits: the end applies to the second, the last (h11 parses it only once the first is
    answered), not to the one being answered. The last answer alone may say ``Connection: close``."""
    url, backend = base
    calls = len(backend.calls)
    received, took = half_closed(url, first + MODELS)
    answers = _answers(received)
    assert [status for status, _ in answers] == [b"HTTP/1.1 200 OK"] * 2, received
    assert answers[1][1].startswith(b'{"object":"list"') and received.lower().count(b"connection: close") <= 1
    assert len(backend.calls) == calls + (first != ECHO)
    assert took < 5 and not errors, errors


@pytest.mark.parametrize("sent", [HEALTH + HEAD + BODY, HEAD + BODY + HEAD + BODY], ids=["health", "scoring"])
def test_a_scoring_request_last_before_the_end_of_the_stream_is_cancelled_those_before_it_answered(base, errors,
                                                                                                 sent):
    """The end of the stream applies to the last request sent before it: on a scoring route it means that the
    client left, and that request is cancelled; the requests before it are answered."""
    url, _ = base
    received, took = half_closed(url, sent)
    assert [status for status, _ in _answers(received)] == [b"HTTP/1.1 200 OK"], received
    time.sleep(0.1)  # an error the cancelled request would log
    assert took < 5 and not errors, errors
