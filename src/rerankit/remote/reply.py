"""Replies as the transport reads them: streamed in under a size cap, then parsed as JSON."""

from __future__ import annotations

import json
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


class CappedBody:
    """A reply's body as it streams in, refused as soon as it outgrows the cap (never held whole in memory)."""

    def __init__(self, response: httpx.Response, cap: int) -> None:
        self._response = response
        self._cap = cap
        self._data = bytearray()
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > cap:
            raise self._too_large(f"announces {int(length):,} bytes")

    def add(self, chunk: bytes) -> None:
        """Take the next decoded chunk."""
        self._data += chunk
        if len(self._data) > self._cap:
            raise self._too_large(f"passed {len(self._data):,} bytes")

    def answer(self) -> Answer:
        """The whole reply."""
        response = self._response
        return Answer(response.status_code, response.headers, bytes(self._data), response.encoding or "utf-8",
                      str(response.url))

    def _too_large(self, what: str) -> RemoteError:
        return RemoteError(f"reply from {self._response.url} {what}, over max_response_bytes={self._cap:,}",
                           url=str(self._response.url))


def parse_json(answer: Answer) -> Any:
    """The body of a successful reply as JSON; a ``RemoteError`` when it is not."""
    try:
        return answer.json()
    except (ValueError, RecursionError):
        raise RemoteError("response is not JSON", answer.status, answer.url, answer.text[:2000]) from None


@dataclass(frozen=True)
class Reply:
    """A discovery probe's answer: HTTP status (None when unreachable) and JSON body (None when not JSON)."""

    status: int | None
    body: Any = None


def probe_reply(answer: Answer) -> Reply:
    """The ``Reply`` of a discovery probe's answer."""
    try:
        return Reply(answer.status, answer.json())
    except (ValueError, RecursionError):
        return Reply(answer.status)
