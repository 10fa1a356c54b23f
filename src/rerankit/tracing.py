"""OpenTelemetry traces, where the ``opentelemetry-api`` package is installed (``pip install 'rerankit[otel]'``).

rerankit records spans through the global tracer provider, so they go wherever the process sends its traces:
``rerankit serve --otlp-traces-endpoint`` sets one up (``rerankit.server.tracing``); an application of your own
that configures OpenTelemetry gets rerankit's spans in its traces. Without the package, or without a provider,
every function here does nothing.

- The remote client (``RemoteBackend``, a proxy's far calls) wraps each HTTP try in a client span and sends the
  W3C trace context (``traceparent``, ``tracestate``) with it, so a far rerankit server (or vLLM, TEI...) continues
  the caller's trace.
- ``rerankit serve`` answers each scoring request under a server span that continues the client's trace context,
  with the time it waited in the queue and the time its engine calls took as child spans.

Spans carry metadata only (paths, statuses, counts, ids): never a query or a document.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, MutableMapping
from typing import Any

from rerankit.errors import hide_credentials

TRACER_NAME = "rerankit"
TRACE_HEADERS = ("traceparent", "tracestate")

try:  # the API only: the SDK and the exporters are the server's (``server/tracing.py``)
    from opentelemetry import context as _context
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
except ImportError:  # pragma: no cover - exercised where the package is absent
    _trace = None


def available() -> bool:
    """Whether the OpenTelemetry API is installed."""
    return _trace is not None


def enabled() -> bool:
    """Whether spans go anywhere: the API is installed and the process has set up a tracer provider (until then
    the API's global is a stand-in whose spans record nothing, and rerankit does no tracing work at all)."""
    return _trace is not None and not isinstance(_trace.get_tracer_provider(), _trace.ProxyTracerProvider)


def _tracer() -> Any:
    from rerankit import __version__

    return _trace.get_tracer(TRACER_NAME, __version__)


def recording() -> bool:
    """Whether a span that records is current (so work spent on attributes is not wasted)."""
    return _trace is not None and _trace.get_current_span().is_recording()


def current_context() -> Any:
    """The current OpenTelemetry context (to carry into work done on the caller's behalf), or None."""
    return _context.get_current() if enabled() else None


@contextlib.contextmanager
def attached(saved: Any) -> Iterator[None]:
    """Run the block under ``saved`` (a ``current_context()``); nothing when it is None."""
    if saved is None or _trace is None:
        yield
        return
    token = _context.attach(saved)
    try:
        yield
    finally:
        _context.detach(token)


def set_attributes(**attributes: Any) -> None:
    """Set ``attributes`` (``rerankit.<name>``; None values skipped) on the current span, where one records."""
    if not recording():
        return
    span = _trace.get_current_span()
    for name, value in attributes.items():
        if value is not None:
            span.set_attribute(f"rerankit.{name}", value)


def inject(headers: MutableMapping[str, str]) -> None:
    """Add the current trace context's ``traceparent`` (and ``tracestate``) to ``headers``, where there is one."""
    if _trace is not None:
        _propagate.inject(headers)


def extract(headers: Any) -> Any:
    """The trace context a request's headers carry (a mapping of lower-case names), or None."""
    return None if _trace is None else _propagate.extract(headers)


class _Try:
    """What ``client_span`` yields: ``status(code)`` records the answer's HTTP status on the span."""

    def __init__(self, span: Any) -> None:
        self.span = span

    def status(self, code: int) -> None:
        if self.span is not None:
            self.span.set_attribute("http.response.status_code", code)
            if code >= 400:
                self.span.set_attribute("error.type", str(code))
                self.span.set_status(_trace.StatusCode.ERROR)


@contextlib.contextmanager
def client_span(method: str, url: str) -> Iterator[_Try]:
    """A client span around one HTTP try to ``url`` (named ``"<method> <url's path>"``), current while the request
    is built, so that ``inject`` sends it as the far server's parent. An error raised in the block marks it
    failed."""
    if not enabled():
        yield _Try(None)
        return
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    attributes = {"http.request.method": method, "url.full": hide_credentials(url),
                  "server.address": parts.hostname or "", "server.port": parts.port or
                  (443 if parts.scheme == "https" else 80)}
    with _tracer().start_as_current_span(f"{method} {parts.path or '/'}", kind=_trace.SpanKind.CLIENT,
                                         attributes=attributes, record_exception=True,
                                         set_status_on_exception=True) as span:
        yield _Try(span if span.is_recording() else None)


def record_span(name: str, start_ns: int, end_ns: int | None = None, **attributes: Any) -> None:
    """A finished child span of the current one, from ``start_ns`` to ``end_ns`` (``time.time_ns()``; None: now),
    with ``rerankit.<name>`` attributes: for stretches timed while no span could be current (queued, scored)."""
    if not recording():
        return
    span = _tracer().start_span(name, start_time=start_ns, attributes={
        f"rerankit.{key}": value for key, value in attributes.items() if value is not None})
    span.end(end_time=time.time_ns() if end_ns is None else end_ns)


def log_ids() -> tuple[str, str] | None:
    """The current span's trace id and span id (hex), for log lines, or None outside a recorded trace."""
    if _trace is None:
        return None
    span_context = _trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return None
    return _trace.format_trace_id(span_context.trace_id), _trace.format_span_id(span_context.span_id)
