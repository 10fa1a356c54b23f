"""Traces of ``rerankit serve``: the OTLP exporter behind ``--otlp-traces-endpoint``, and ``Traces``, the pure ASGI
middleware that answers each scoring request under a server span.

The span continues the trace context the client sent (``traceparent``, ``tracestate``), is named
``"<method> <path>"`` (``POST /v1/rerank``), and holds the HTTP semantic conventions' attributes (method, path,
route, status, client address, user agent) and ``rerankit.request_id``; the route adds the dialect, the item and
token counts and the model (``rerankit.tracing.set_attributes``), and the batcher the time queued and the time
scored as child spans. A 5xx marks the span failed; a 4xx is the client's fault and does not (as the conventions
ask of server spans). Only the scoring paths are traced: probes and scrapes (``/health``, ``/metrics``) would
drown them.

``setup_tracing`` installs the SDK's tracer provider: spans go in batches to the endpoint over OTLP, by
``http/protobuf`` (POST to ``<endpoint>/v1/traces`` unless the URL has that path) or ``grpc``.
``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (or ``$OTEL_EXPORTER_OTLP_PROTOCOL``) picks; without either, port 4317
(OTLP's gRPC port) means gRPC and any other HTTP. The SDK's own variables apply too: ``$OTEL_TRACES_SAMPLER``
(e.g. ``parentbased_traceidratio`` with ``$OTEL_TRACES_SAMPLER_ARG=0.1``), ``$OTEL_EXPORTER_OTLP_HEADERS``,
``$OTEL_RESOURCE_ATTRIBUTES``, ``$OTEL_BSP_SCHEDULE_DELAY``.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Container
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rerankit import tracing
from rerankit.errors import RerankitError

PROTOCOLS = ("http/protobuf", "grpc")
GRPC_PORT = 4317
DEFAULT_SERVICE_NAME = "rerankit"
_PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_EXPORTERS = {"http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
              "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"}
_PACKAGES = {"http/protobuf": "'rerankit[otel]'", "grpc": "'rerankit[otel]' opentelemetry-exporter-otlp-proto-grpc"}


def otlp_protocol(endpoint: str) -> str:
    """The OTLP protocol for ``endpoint``: the environment's choice, else gRPC on port 4317 and HTTP otherwise."""
    for name in _PROTOCOL_ENVS:
        chosen = os.environ.get(name, "").strip().lower()
        if chosen:
            if chosen not in PROTOCOLS:
                raise RerankitError(f"${name}={chosen!r}: rerankit exports traces by {' or '.join(PROTOCOLS)}")
            return chosen
    try:
        port = urlsplit(endpoint).port
    except ValueError:
        port = None
    return "grpc" if port == GRPC_PORT else "http/protobuf"


def traces_url(endpoint: str, protocol: str) -> str:
    """Where the exporter sends: OTLP/HTTP posts to ``/v1/traces`` (added to a URL without it); gRPC takes the
    URL as it is."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RerankitError(f"--otlp-traces-endpoint {endpoint!r}: give the collector's URL, "
                            "e.g. http://localhost:4318 (OTLP/HTTP) or http://localhost:4317 (gRPC)")
    if protocol == "grpc" or parts.path.rstrip("/").endswith("/v1/traces"):
        return endpoint
    return endpoint.rstrip("/") + "/v1/traces"


def tracer_provider(endpoint: str, service_name: str | None = None) -> Any:
    """An SDK tracer provider that sends every span to the OTLP collector at ``endpoint`` (see the module's
    docstring for the protocol), as service ``service_name`` (else ``$OTEL_SERVICE_NAME``, else "rerankit").
    ``RerankitError`` when the packages are missing or the endpoint is no URL."""
    protocol = otlp_protocol(endpoint)
    url = traces_url(endpoint, protocol)
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter_module = importlib.import_module(_EXPORTERS[protocol])
    except ImportError as exc:
        raise RerankitError(f"--otlp-traces-endpoint by {protocol} needs OpenTelemetry's SDK and exporter "
                            f"({exc.name} is missing): pip install {_PACKAGES[protocol]}") from None
    name = service_name or os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(exporter_module.OTLPSpanExporter(endpoint=url)))
    return provider


def setup_tracing(endpoint: str, service_name: str | None = None) -> Any:
    """``tracer_provider(endpoint, service_name)``, installed as the process's: every span rerankit (and any other
    library) records goes there. Returns it: ``shutdown()`` it to send what is left."""
    from opentelemetry import trace

    provider = tracer_provider(endpoint, service_name)
    trace.set_tracer_provider(provider)
    return provider


class Traces:
    """Wraps an ASGI app: each HTTP request to one of ``paths`` runs under a server span (module docstring)."""

    def __init__(self, app: ASGIApp, paths: Container[str]) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in self.paths or not tracing.enabled():
            await self.app(scope, receive, send)
            return
        from opentelemetry import context, trace

        headers: dict[str, str] = {}
        for name, value in scope.get("headers", ()):
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        method, path = scope.get("method", "GET"), scope["path"]
        tracer = trace.get_tracer(tracing.TRACER_NAME)
        span = tracer.start_span(f"{method} {path}", context=tracing.extract(headers), kind=trace.SpanKind.SERVER,
                                 attributes=_request_attributes(scope, headers))
        status = 500  # unless the app starts a response

        async def send_traced(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                request_id = next((value for name, value in message.get("headers", ())
                                   if name.lower() == b"x-request-id"), None)
                if request_id is not None and span.is_recording():
                    span.set_attribute("rerankit.request_id", request_id.decode("latin-1"))
            await send(message)

        token = context.attach(trace.set_span_in_context(span))
        try:
            await self.app(scope, receive, send_traced)
        except BaseException as exc:
            span.record_exception(exc)
            raise
        finally:
            context.detach(token)
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_attribute("error.type", str(status))
                span.set_status(trace.StatusCode.ERROR)
            span.end()


def _request_attributes(scope: Scope, headers: dict[str, str]) -> dict[str, Any]:
    """The HTTP semantic conventions' attributes of a server span for ``scope``."""
    attributes: dict[str, Any] = {"http.request.method": scope.get("method", "GET"), "url.path": scope["path"],
                                  "http.route": scope["path"], "url.scheme": scope.get("scheme", "http"),
                                  "network.protocol.version": scope.get("http_version", "1.1")}
    server, client = scope.get("server"), scope.get("client")
    if server:
        attributes["server.address"], attributes["server.port"] = server[0], server[1] or 0
    if client:
        attributes["client.address"] = client[0]
    if headers.get("user-agent"):
        attributes["user_agent.original"] = headers["user-agent"]
    return attributes
