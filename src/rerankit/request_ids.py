"""Request ids for tracing: the ``X-Request-Id`` of the request being served, kept in a context variable.

``rerankit serve`` sets ``REQUEST_ID`` for each HTTP request (``rerankit.server.request_ids``); the remote client
sends the id it finds there as ``X-Request-Id`` on its requests to a far server, so a chain of proxies keeps one id
end to end. Code of your own can set it around a remote call too.
"""

from __future__ import annotations

import uuid
from contextvars import ContextVar

HEADER = "X-Request-Id"
MAX_LENGTH = 128

# The id of the request this code runs for; None outside one. Tasks and ``contextvars.copy_context()`` inherit it.
REQUEST_ID: ContextVar[str | None] = ContextVar("rerankit_request_id", default=None)


def usable_request_id(value: str | bytes | None) -> str | None:
    """``value`` as an id when it is 1 to ``MAX_LENGTH`` visible ASCII characters (``!`` to ``~``: no spaces, no
    control characters), else None: such a value is never echoed, logged or forwarded."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if not value or len(value) > MAX_LENGTH or not all("!" <= char <= "~" for char in value):
        return None
    return value


def new_request_id() -> str:
    """A fresh id: 32 hex digits (a random UUID)."""
    return uuid.uuid4().hex
