"""Replies as the transport reads them: streamed in under a size cap, then parsed as JSON."""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from typing import Any

import httpx

from rerankit.errors import RemoteError


@dataclass(frozen=True)
class Answer:
    """A reply read in full: status, headers and the (decoded) body bytes."""

    status: int
    headers: httpx.Headers
    data: bytes
    encoding: str
    url: str

    @property
    def text(self) -> str:
        """The body as text (undecodable bytes replaced)."""
        return self.data.decode(self.encoding, errors="replace")

    def json(self) -> Any:
        """The parsed body; ``NaN`` and ``Infinity`` parse to floats, for the dialects' decoders to refuse."""
        return json.loads(self.data)


# What the client asks replies to be compressed with: the codings it decodes under the cap (``CappedBody``).
ACCEPT_ENCODING = "gzip, deflate"


class CappedBody:
    """A reply's body as it streams in (raw, as sent), refused as soon as it outgrows the cap, decoded or not: a
    gzip or deflate reply is inflated at most to the cap, so a small compressed reply cannot fill memory. Another
    coding (br, zstd: never asked for, see ``ACCEPT_ENCODING``) is a ``RemoteError``."""

    def __init__(self, response: httpx.Response, cap: int) -> None:
        self._response = response
        self.read = response.is_stream_consumed  # already read whole (an in-memory reply): ``content`` is decoded
        self._cap = cap
        self._data = bytearray()
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > cap:
            raise self._too_large(f"announces {int(length):,} bytes")
        coding = "identity" if self.read else response.headers.get("content-encoding", "identity").strip().lower()
        if coding not in ("identity", "", "gzip", "x-gzip", "deflate"):
            raise RemoteError(f"reply from {response.url} is compressed as {coding!r}, which the client did not ask "
                              f"for (Accept-Encoding: {ACCEPT_ENCODING})", url=str(response.url))
        wbits = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}.get(coding)
        self._inflate = None if wbits is None else zlib.decompressobj(wbits)
        self._first = True  # deflate is sent zlib-wrapped or raw: the first chunk tells which

    def add(self, chunk: bytes) -> None:
        """Take the next chunk as it came over the wire."""
        if self._inflate is None:
            self._take(chunk)
            return
        try:
            out = self._inflate.decompress(chunk, self._cap - len(self._data) + 1)
        except zlib.error:
            if not self._first:
                raise self._undecodable() from None
            self._inflate = zlib.decompressobj(-zlib.MAX_WBITS)  # raw deflate, as some servers send it
            try:
                out = self._inflate.decompress(chunk, self._cap - len(self._data) + 1)
            except zlib.error:
                raise self._undecodable() from None
        self._first = False
        self._take(out)
        if self._inflate.unconsumed_tail:  # more would come out than the cap leaves room for
            raise self._too_large(f"inflates past {len(self._data):,} bytes")

    def _take(self, data: bytes) -> None:
        self._data += data
        if len(self._data) > self._cap:
            raise self._too_large(f"passed {len(self._data):,} bytes")

    def answer(self) -> Answer:
        """The whole reply, decoded."""
        if self._inflate is not None:
            try:
                self._take(self._inflate.flush())
            except zlib.error:
                raise self._undecodable() from None
        response = self._response
        return Answer(response.status_code, response.headers, bytes(self._data), response.encoding or "utf-8",
                      str(response.url))

    def _undecodable(self) -> RemoteError:
        coding = self._response.headers.get("content-encoding")
        return RemoteError(f"reply from {self._response.url} is not valid {coding} data", url=str(self._response.url))

    def _too_large(self, what: str) -> RemoteError:
        return RemoteError(f"reply from {self._response.url} {what}, over max_response_bytes={self._cap:,}",
                           url=str(self._response.url))


def parse_json(answer: Answer) -> Any:
    """The body of a successful reply as JSON; a ``RemoteError`` when it is not."""
    try:
        return answer.json()
    except (ValueError, RecursionError):
        raise RemoteError("response is not JSON", answer.status, answer.url, answer.text[:2000]) from None


def retry_after_of(headers: httpx.Headers) -> float | None:
    """``Retry-After`` in seconds (the HTTP-date form is left to the backoff)."""
    try:
        seconds = float(headers.get("retry-after", ""))
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def retryable_status(status: int) -> bool:
    """Whether an answer of this status is worth asking again (a starting or busy server): 429 and 5xx."""
    return status == 429 or status >= 500


@dataclass(frozen=True)
class Reply:
    """A discovery probe's answer: HTTP status (None when unreachable), JSON body (None when not JSON), and its
    ``Retry-After`` in seconds; when unreachable, why (``error``), whether another try may fare better
    (``transient``: a refused connection or a timeout, as a scoring call's tries have it) and whether the call's
    deadline passed while it was waited for (``expired``)."""

    status: int | None
    body: Any = None
    retry_after: float | None = None
    error: str | None = None
    transient: bool = False
    expired: bool = False

    @property
    def retryable(self) -> bool:
        """What a starting or busy server answers, asked again as a scoring call's try would be: no connection,
        429 or 5xx."""
        return self.transient if self.status is None else retryable_status(self.status)


def probe_reply(answer: Answer) -> Reply:
    """The ``Reply`` of a discovery probe's answer."""
    try:
        body = answer.json()
    except (ValueError, RecursionError):
        body = None
    return Reply(answer.status, body, retry_after_of(answer.headers))
