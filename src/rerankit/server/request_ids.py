"""``RequestIds``: the pure ASGI middleware that gives every HTTP request an id and every response its
``X-Request-Id``.

The id is the client's ``X-Request-Id`` where it is usable (``rerankit.request_ids.usable_request_id``), else a
fresh one. It is set in ``rerankit.request_ids.REQUEST_ID`` while the app runs, so that the routes' log lines name
it and a proxy's remote client forwards it. A pure ASGI middleware, not starlette's ``BaseHTTPMiddleware``: the app
gets the server's own ``receive`` (the routes watch it for the client's disconnect) and its own task.
"""

from __future__ import annotations

import logging
from typing import Callable

from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rerankit.request_ids import HEADER, REQUEST_ID, new_request_id, usable_request_id

log = logging.getLogger("rerankit.server")

_HEADER = HEADER.lower().encode("latin-1")


def request_id_of(scope: Scope) -> str:
    """The id of the request ``scope``: its first ``X-Request-Id`` header where usable, else a fresh one."""
    given = next((value for name, value in scope.get("headers", ()) if name.lower() == _HEADER), None)
    return usable_request_id(given) or new_request_id()


class RequestIds:
    """Wraps an ASGI app: each HTTP request runs with its id in ``REQUEST_ID``; each response carries it.
    ``unhandled(scope, request_id)`` is the answer to an error the app let through (None: a plain-text 500)."""

    def __init__(self, app: ASGIApp, unhandled: Callable[[Scope, str], Response] | None = None) -> None:
        self.app = app
        self.unhandled = unhandled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        raw_id = request_id.encode("latin-1")
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(name, value) for name, value in message.get("headers", ()) if name.lower() != _HEADER]
                message = {**message, "headers": [*headers, (_HEADER, raw_id)]}
            await send(message)

        token = REQUEST_ID.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            # Answered here, not by starlette's outer error handler (which would send its 500 without the id); the
            # error goes on up to be logged with its traceback.
            log.error("request %s on %s failed with an unhandled error", request_id, scope.get("path", ""))
            if not started:
                response = self.unhandled(scope, request_id) if self.unhandled is not None else \
                    PlainTextResponse("Internal Server Error", status_code=500)
                await response(scope, receive, send_with_id)
            raise
        finally:
            REQUEST_ID.reset(token)
