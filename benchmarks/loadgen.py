"""A lean HTTP/1.1 load generator: one keep-alive connection per simulated client, raw asyncio streams.

``benchmarks/serve_load.py`` first drove its clients through one ``httpx.AsyncClient``. Its connection pool does
work per request that grows with the connections it holds, so past ~32 clients the load generator, not the server,
set the pace: against a server whose backend answers at once (2-core box, 2026-11-25), httpx reached 3,981 items/s
at 16 clients, 2,098 at 64 and 1,041 at 128, where this client (like aiohttp's) held 3,500-3,700 at all three. On
an H100 the same collapse looked like the server's (64 clients: 928 items/s, 1.64 requests an engine call, the
engine thread idle in py-spy). Each client here owns its socket, so no client waits on another's bookkeeping.
"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit


class HttpError(Exception):
    """The connection failed or the reply was not HTTP/1.1 as expected."""


class Connection:
    """One client's keep-alive connection to ``url``; reconnects when the server closes it."""

    def __init__(self, url: str, timeout: float = 120.0) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.timeout = timeout
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: object | None = None,
                      headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
        """Send one request (``body`` as JSON, ``headers`` besides the usual) and return (status, body bytes,
        headers with lower-case names)."""
        payload = b"" if body is None else json.dumps(body).encode()
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{extra}"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
        for attempt in (0, 1):  # a keep-alive connection the server closed meanwhile is reopened once
            if self._writer is None:
                self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
            try:
                self._writer.write(head + payload)
                return await asyncio.wait_for(self._read_reply(), self.timeout)
            except (ConnectionError, asyncio.IncompleteReadError, HttpError) as error:
                self.close()
                if attempt or not isinstance(error, (ConnectionError, asyncio.IncompleteReadError)):
                    raise HttpError(str(error) or type(error).__name__) from error
        raise AssertionError("unreachable")

    async def _read_reply(self) -> tuple[int, bytes, dict[str, str]]:
        assert self._reader is not None
        header = await self._reader.readuntil(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = {name.strip().lower(): value.strip() for name, _, value in
                  (line.partition(":") for line in lines[1:] if line)}
        if fields.get("transfer-encoding", "").lower() == "chunked":
            body = await self._read_chunked()
        elif "content-length" in fields:
            body = await self._reader.readexactly(int(fields["content-length"]))
        else:
            raise HttpError("reply without a length")
        if fields.get("connection", "").lower() == "close":
            self.close()
        return status, body, fields

    async def _read_chunked(self) -> bytes:
        assert self._reader is not None
        chunks = []
        while True:
            size = int((await self._reader.readuntil(b"\r\n")).split(b";")[0], 16)
            chunk = await self._reader.readexactly(size + 2)
            if size == 0:
                return b"".join(chunks)
            chunks.append(chunk[:-2])

    def close(self) -> None:
        """Drop the socket (the next request opens a new one)."""
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
