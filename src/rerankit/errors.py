"""The one error hierarchy of rerankit. Every error a user should handle is a ``RerankitError``."""

from __future__ import annotations

import copy
import copyreg
import re


# The user info of a URL runs to the authority's last "@" (a password may hold "@", as httpx reads it); the remote
# client refuses URLs with whitespace, so the authority ends at "/", "?", "#" or whitespace.
_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)[^/?#\s]*@")


def hide_credentials(text: str) -> str:
    """``text`` with the ``user:password@`` of every URL in it taken out: a far server's URL may carry them, and an
    error message reaches logs and a proxy's clients."""
    return _USERINFO.sub(r"\1", text)


class RerankitError(Exception):
    """Base of every error rerankit raises on purpose."""

    status_code: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple:
        # Rebuilt from its args and attributes without calling __init__ (subclasses take other arguments): every
        # subclass crosses processes (the data-parallel replicas) and ``copy.copy`` as it is.
        return copyreg.__newobj__, (type(self), *self.args), self.__dict__


class InvalidRequest(RerankitError, ValueError):
    """The request cannot be scored as given; ``field`` names the offending field."""

    status_code = 400
    error_type = "invalid_request"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message

    def renamed(self, field: str) -> "InvalidRequest":
        """A copy (same class, same attributes: a 413's limit) that names ``field`` instead."""
        twin = copy.copy(self)
        Exception.__init__(twin, f"{field}: {self.reason}")
        twin.field, twin.message = field, f"{field}: {self.reason}"
        return twin


def shift_item_index(error: BaseException, start: int) -> BaseException:
    """``error`` with the index of its ``items[k]`` field moved up by ``start`` (where a slice of a request's items
    began), as a copy of its class with its own attributes; any other error as it is."""
    match = re.match(r"items\[(\d+)\]", getattr(error, "field", "")) if isinstance(error, InvalidRequest) else None
    if match is None or start == 0:
        return error
    return error.renamed(f"items[{int(match.group(1)) + start}]{error.field[match.end():]}")


class RequestTooLarge(InvalidRequest):
    """A size limit (items, tokens, body) is exceeded; ``limit`` is the configured bound."""

    status_code = 413
    error_type = "request_too_large"

    def __init__(self, field: str, message: str, limit: int) -> None:
        super().__init__(field, message)
        self.limit = limit


class UnsupportedMediaType(InvalidRequest):
    """A request body that is not declared as JSON (``Content-Type``) where only JSON is taken."""

    status_code = 415
    error_type = "unsupported_media_type"


class BodyTimeout(InvalidRequest):
    """A request body that did not arrive whole within the server's ``body_timeout_s``."""

    status_code = 408
    error_type = "request_timeout"


class Unauthorized(RerankitError):
    """The server has an API key and the request did not carry it."""

    status_code = 401
    error_type = "unauthorized"


class ModelLoadError(RerankitError):
    """The model could not be found, loaded, or used in the asked mode."""

    status_code = 500
    error_type = "model_load_error"


class RemoteError(RerankitError):
    """A remote server answered with an error, or could not be reached after retries; ``reason`` and ``field`` are
    what its error body said, ``retry_after`` the seconds its ``Retry-After`` header asked for (None: it sent none).
    Its message and ``url`` never carry a URL's user and password."""

    error_type = "remote_error"

    def __init__(self, message: str, status_code: int | None = None, url: str | None = None,
                 body: str | None = None, field: str | None = None, retry_after: float | None = None) -> None:
        url = hide_credentials(url) if url is not None else None
        message = hide_credentials(message)
        super().__init__(message if status_code is None else f"HTTP {status_code} from {url}: {message}")
        self.status_code = status_code if status_code is not None else 502
        self.url = url
        self.body = body
        self.reason = message  # the far server's own words (without the status and URL)
        self.field = field  # the field its error body named, if any
        self.retry_after = retry_after


class Overloaded(RerankitError):
    """The server's queue is full; try again later."""

    status_code = 429
    error_type = "overloaded"


class UpstreamError(RerankitError):
    """A far server's error as a proxy answers it: ``status_code``, the far server's message and ``field``, and the
    seconds its ``Retry-After`` asked for (None: none, or not a busy status)."""

    error_type = "upstream_error"

    def __init__(self, status_code: int, message: str, field: str | None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.field = field
        self.retry_after = retry_after


class TooManyConnections(RerankitError):
    """A connection over the server's ``max_connections`` while every other one has a request running."""

    status_code = 503
    error_type = "overloaded"


class ShuttingDown(RerankitError):
    """The server is draining for shutdown: it takes no new work and answers what is left with this."""

    status_code = 503
    error_type = "shutting_down"


class ReplicaDied(RerankitError):
    """A data-parallel replica process died with this work in flight, and the one retry elsewhere failed too."""

    status_code = 503
    error_type = "replica_died"


class Cancelled(RerankitError):
    """The work was stopped before it finished because every caller waiting for it went away (``should_stop``)."""

    status_code = 499  # nginx's "client closed request": nobody is left to read it
    error_type = "cancelled"
