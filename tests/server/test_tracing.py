"""OpenTelemetry traces: rerankit serve answers each scoring request under a server span that continues the
client's W3C trace context, with its queue and engine time as child spans; the remote client (a proxy's far calls,
a RemoteBackend in an application) sends its own client span's context on, so a chain of servers is one trace; the
OTLP exporters deliver to real receivers, over HTTP and gRPC; ``rerankit serve --otlp-traces-endpoint`` end to end."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")

from live_server import live_server, wait_until_healthy  # noqa: E402
from opentelemetry import trace  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult  # noqa: E402
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402
from server_fakes import RecordingBackend  # noqa: E402

from rerankit.errors import RerankitError  # noqa: E402
from rerankit.remote import RemoteBackend  # noqa: E402
from rerankit.schema import ScoreRequest  # noqa: E402
from rerankit.server import tracing as server_tracing  # noqa: E402
from rerankit.server.app import create_app  # noqa: E402
from rerankit.server.limits import ServerConfig  # noqa: E402
from rerankit.server.logs import JsonFormatter  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
RERANK = {"query": "secret-query", "documents": ["a", "bb", "secret-doc"]}


class Switch(Sampler):
    """Records spans only while ``on``: the rest of the test session pays nothing for this module's provider."""

    on = False

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None) -> SamplingResult:  # a sampler hands the span its starting attributes
        return SamplingResult(Decision.RECORD_AND_SAMPLE if self.on else Decision.DROP, attributes)

    def get_description(self) -> str:
        return "switch"


EXPORTER = InMemorySpanExporter()
SWITCH = Switch()


@pytest.fixture(scope="module")
def provider():
    if not isinstance(trace.get_tracer_provider(), TracerProvider):  # a process sets its provider once
        sdk_provider = TracerProvider(sampler=SWITCH)
        sdk_provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(sdk_provider)
    SWITCH.on = True
    yield EXPORTER
    SWITCH.on = False


@pytest.fixture
def spans(provider):
    provider.clear()
    return provider


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def finished(exporter: InMemorySpanExporter, name: str, count: int = 1, timeout: float = 5.0) -> list:
    """The finished spans named ``name``, once there are ``count`` (a server span ends after its response)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [span for span in exporter.get_finished_spans() if span.name == name]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


@pytest.fixture(scope="module")
def url(provider):
    with live_server(create_app(RecordingBackend(), ServerConfig(batch_window_ms=0))) as base:
        yield base


def test_a_scoring_request_continues_the_callers_trace_with_its_queue_and_engine_time(url, spans):
    reply = httpx.post(url + "/v1/rerank", json=RERANK, headers={"traceparent": TRACEPARENT, "X-Request-Id": "r-1"},
                       timeout=10)
    assert reply.status_code == 200
    [server] = finished(spans, "POST /v1/rerank")
    assert server.kind == SpanKind.SERVER
    assert (format(server.context.trace_id, "032x"), format(server.parent.span_id, "016x")) == (TRACE_ID, PARENT_ID)
    assert server.parent.is_remote
    attributes = dict(server.attributes)
    assert {key: attributes[key] for key in ("http.request.method", "url.path", "http.route",
                                             "http.response.status_code", "rerankit.request_id", "rerankit.dialect",
                                             "rerankit.items", "rerankit.prompt_tokens", "rerankit.model")} == {
        "http.request.method": "POST", "url.path": "/v1/rerank", "http.route": "/v1/rerank",
        "http.response.status_code": 200, "rerankit.request_id": "r-1", "rerankit.dialect": "vllm-rerank",
        "rerankit.items": 3, "rerankit.prompt_tokens": 13, "rerankit.model": "recording"}
    assert attributes["client.address"] == "127.0.0.1" and "python-httpx" in attributes["user_agent.original"]
    assert server.status.status_code == StatusCode.UNSET
    children = {span.name: span for span in spans.get_finished_spans() if span.parent is not None
                and span.parent.span_id == server.context.span_id}
    assert set(children) == {"rerankit.queue", "rerankit.engine"}
    queue, engine = children["rerankit.queue"], children["rerankit.engine"]
    assert server.start_time <= queue.start_time <= queue.end_time == engine.start_time <= engine.end_time
    assert engine.end_time <= server.end_time
    assert dict(engine.attributes) == {"rerankit.chunks": 1, "rerankit.engine_calls": 1}
    recorded = json.dumps([dict(span.attributes) for span in spans.get_finished_spans()])
    assert "secret" not in recorded  # metadata only: no query, no document


def test_a_request_without_a_trace_context_starts_one_and_each_request_has_its_own(url, spans):
    for _ in range(2):
        assert httpx.post(url + "/rerank", json=RERANK, timeout=10).status_code == 200
    first, second = finished(spans, "POST /rerank", 2)
    assert first.parent is None and second.parent is None
    assert first.context.trace_id != second.context.trace_id


def test_a_4xx_is_the_clients_fault_a_5xx_fails_the_span_and_probes_are_not_traced(spans):
    class Broken(RecordingBackend):  # fails as a bug would, merged and one by one
        def score(self, request):
            raise RuntimeError("boom")

        def score_batch(self, requests, *, return_exceptions=False):
            raise RuntimeError("boom")

    with live_server(create_app(Broken(), ServerConfig(batch_window_ms=0))) as base:
        assert httpx.post(base + "/v1/rerank", json={"query": "q"}, timeout=10).status_code == 400
        assert httpx.post(base + "/v1/rerank", json=RERANK, timeout=10).status_code == 500
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        assert httpx.get(base + "/metrics", timeout=10).status_code == 200
    refused, failed = finished(spans, "POST /v1/rerank", 2)
    assert refused.attributes["http.response.status_code"] == 400
    assert refused.status.status_code == StatusCode.UNSET and "error.type" not in refused.attributes
    assert failed.attributes["http.response.status_code"] == 500 and failed.attributes["error.type"] == "500"
    assert failed.status.status_code == StatusCode.ERROR
    assert {span.name for span in spans.get_finished_spans()} <= {"POST /v1/rerank", "rerankit.queue",
                                                                  "rerankit.engine"}


def test_a_proxy_chain_is_one_trace_client_span_between_the_two_servers(spans):
    with live_server(create_app(RecordingBackend(), ServerConfig(batch_window_ms=0))) as far_url, \
            RemoteBackend(far_url, dialect="vllm-rerank") as remote, \
            live_server(create_app(remote, ServerConfig())) as near_url:
        reply = httpx.post(near_url + "/v2/rerank", json={**RERANK, "model": "m"},
                           headers={"traceparent": TRACEPARENT}, timeout=10)
        assert reply.status_code == 200, reply.text
        near = finished(spans, "POST /v2/rerank")[0]
        far = finished(spans, "POST /rerank", 2)  # vLLM's rerank path: the client's span and the far server's
    client = [span for span in far if span.kind == SpanKind.CLIENT]
    server = [span for span in far if span.kind == SpanKind.SERVER]
    assert len(client) == 1 and len(server) == 1
    client, server = client[0], server[0]
    assert {format(span.context.trace_id, "032x") for span in (near, client, server)} == {TRACE_ID}
    assert client.parent.span_id == near.context.span_id
    assert server.parent.span_id == client.context.span_id and server.parent.is_remote
    assert client.attributes["http.response.status_code"] == 200
    assert client.attributes["url.full"] == far_url + "/rerank"


def test_an_applications_remote_calls_sync_split_and_async_are_children_of_its_own_span(url, spans):
    tracer = trace.get_tracer("an-app")
    request = ScoreRequest(query="q", items=[f"doc {number}" for number in range(6)])
    with RemoteBackend(url, dialect="vllm-rerank", max_items_per_request=2) as remote:
        with tracer.start_as_current_span("retrieve-and-rerank") as step:
            assert len(remote.score(request).results) == 6  # three requests on the client's threads

        async def scored():
            with tracer.start_as_current_span("async-step") as async_step:
                await remote.ascore(request)
                return async_step

        async_step = asyncio.run(scored())
    clients = [span for span in spans.get_finished_spans() if span.kind == SpanKind.CLIENT]
    assert len(clients) == 6
    assert sorted(span.parent.span_id for span in clients) == sorted(
        [step.get_span_context().span_id] * 3 + [async_step.get_span_context().span_id] * 3)
    servers = [span for span in finished(spans, "POST /rerank", 12) if span.kind == SpanKind.SERVER]
    assert {span.parent.span_id for span in servers} == {span.context.span_id for span in clients}


def test_json_log_lines_written_inside_a_traced_request_name_its_trace(spans):
    formatter = JsonFormatter()
    record = logging.LogRecord("rerankit.server", logging.INFO, __file__, 1, "scored", None, None)
    assert "trace_id" not in json.loads(formatter.format(record))
    with trace.get_tracer("an-app").start_as_current_span("request") as span:
        line = json.loads(formatter.format(record))
    assert line["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert line["span_id"] == format(span.get_span_context().span_id, "016x")


class HttpCollector(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver: each POST to /v1/traces decoded with the protocol's own message types."""

    received: list = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        export = trace_service_pb2.ExportTraceServiceRequest()
        export.ParseFromString(body)
        self.received.append((self.path, self.headers.get("Content-Type"), export))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args) -> None:
        pass


def exported_spans(exports: list) -> list[tuple[str, str, object]]:
    """(service name, span name, span) of every span in the receiver's export requests."""
    out = []
    for export in exports:
        for resource_spans in export.resource_spans:
            service = next(attribute.value.string_value for attribute in resource_spans.resource.attributes
                           if attribute.key == "service.name")
            out.extend((service, span.name, span) for scope in resource_spans.scope_spans for span in scope.spans)
    return out


@pytest.fixture
def http_collector():
    HttpCollector.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), HttpCollector)
    # a 0.05 s poll: shutdown() waits for serve_forever's next poll (0.5 s by default)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", HttpCollector.received
    finally:
        server.shutdown()
        server.server_close()


def test_the_otlp_http_exporter_posts_to_v1_traces_as_the_service(http_collector, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    endpoint, received = http_collector
    provider = server_tracing.tracer_provider(endpoint, "reranker-a")
    with provider.get_tracer("test").start_as_current_span("work"):
        pass
    provider.shutdown()  # sends what is batched
    [(path, content_type, export)] = received
    assert (path, content_type) == ("/v1/traces", "application/x-protobuf")
    assert [(service, name) for service, name, _ in exported_spans([export])] == [("reranker-a", "work")]


def test_the_otlp_grpc_exporter_delivers_to_a_grpc_collector(monkeypatch):
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    received: list = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the service's name
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        provider = server_tracing.tracer_provider(f"http://127.0.0.1:{port}")
        with provider.get_tracer("test").start_as_current_span("work"):
            pass
        provider.shutdown()
    finally:
        server.stop(None)
    assert [(service, name) for service, name, _ in exported_spans(received)] == [("rerankit", "work")]


@pytest.mark.parametrize(("endpoint", "env", "protocol", "sent_to"), [
    ("http://collector:4318", None, "http/protobuf", "http://collector:4318/v1/traces"),
    ("http://collector:4318/v1/traces", None, "http/protobuf", "http://collector:4318/v1/traces"),
    ("https://otel.example.com/", None, "http/protobuf", "https://otel.example.com/v1/traces"),
    ("http://collector:4317", None, "grpc", "http://collector:4317"),
    ("http://collector:4317", "http/protobuf", "http/protobuf", "http://collector:4317/v1/traces"),
    ("http://collector:9000", "grpc", "grpc", "http://collector:9000"),
])
def test_the_protocol_follows_the_environment_else_the_port(monkeypatch, endpoint, env, protocol, sent_to):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    if env is None:
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    else:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env)
    assert server_tracing.otlp_protocol(endpoint) == protocol
    assert server_tracing.traces_url(endpoint, protocol) == sent_to


def test_set_up_errors_name_the_flag_the_variable_and_the_package(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(RerankitError, match=r"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'.*http/protobuf or grpc"):
        server_tracing.tracer_provider("http://collector:4318")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    with pytest.raises(RerankitError, match="--otlp-traces-endpoint 'collector:4318': give the collector's URL"):
        server_tracing.tracer_provider("collector:4318")
    real_import = server_tracing.importlib.import_module

    def without_grpc(name, *args):
        if "grpc" in name:
            raise ImportError(f"No module named {name!r}", name=name)
        return real_import(name, *args)

    monkeypatch.setattr(server_tracing.importlib, "import_module", without_grpc)
    with pytest.raises(RerankitError, match=r"by grpc needs .* pip install 'rerankit\[otel\]' "
                                            r"opentelemetry-exporter-otlp-proto-grpc"):
        server_tracing.tracer_provider("http://collector:4317")


def test_serve_refuses_a_service_name_without_an_endpoint():
    from rerankit.server.main import serve

    with pytest.raises(RerankitError, match="--otlp-service-name .* give both"):
        serve("some-model", port=0, otlp_service_name="reranker")


def test_rerankit_serve_sends_its_spans_to_the_collector(tiny_bert_cross_encoder, http_collector):
    endpoint, received = http_collector
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    env.pop("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", None)
    env.pop("OTEL_EXPORTER_OTLP_PROTOCOL", None)
    command = [sys.executable, "-m", "rerankit", "serve", "--model", str(tiny_bert_cross_encoder), "--device", "cpu",
               "--port", str(port), "--no-warmup", "--otlp-traces-endpoint", endpoint,
               "--otlp-service-name", "reranker-b"]
    server = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(server, url)
        reply = httpx.post(url + "/rerank", json=RERANK, headers={"traceparent": TRACEPARENT}, timeout=30)
        assert reply.status_code == 200, reply.text
    finally:
        server.terminate()
        server.communicate(timeout=30)
    spans = exported_spans([export for _, _, export in received])
    named = {name: (service, span) for service, name, span in spans}
    assert set(named) == {"POST /rerank", "rerankit.queue", "rerankit.engine"}, named.keys()
    service, span = named["POST /rerank"]
    assert service == "reranker-b"
    assert (span.trace_id.hex(), span.parent_span_id.hex()) == (TRACE_ID, PARENT_ID)
    attributes = {attribute.key: attribute.value for attribute in span.attributes}
    assert attributes["http.response.status_code"].int_value == 200
    assert attributes["rerankit.items"].int_value == 3


def test_without_the_opentelemetry_package_requests_and_remote_calls_run_untraced(url, spans, monkeypatch):
    import rerankit.tracing

    monkeypatch.setattr(rerankit.tracing, "_trace", None)  # as where the package is not installed
    assert not rerankit.tracing.available() and rerankit.tracing.log_ids() is None
    headers: dict[str, str] = {}
    rerankit.tracing.inject(headers)
    assert headers == {}
    with RemoteBackend(url, dialect="vllm-rerank") as remote:
        assert len(remote.score(ScoreRequest(query="q", items=["a", "b"])).results) == 2
    assert httpx.post(url + "/v1/rerank", json=RERANK, timeout=10).status_code == 200
    assert spans.get_finished_spans() == ()


def test_before_a_tracer_provider_is_set_up_no_tracing_work_is_done(url, spans, monkeypatch):
    import rerankit.tracing

    monkeypatch.setattr(rerankit.tracing._trace, "get_tracer_provider", lambda: trace.ProxyTracerProvider())
    assert rerankit.tracing.available() and not rerankit.tracing.enabled()
    assert rerankit.tracing.current_context() is None
    with RemoteBackend(url, dialect="vllm-rerank") as remote:
        assert len(remote.score(ScoreRequest(query="q", items=["a", "b"])).results) == 2
    assert spans.get_finished_spans() == ()
