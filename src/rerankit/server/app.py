"""The FastAPI app of ``rerankit serve``: the scoring routes of every dialect over one backend, plus
``/health``, ``/v1/models``, ``/metrics`` and FastAPI's OpenAPI pages (``/docs``, ``/openapi.json``). Every
response carries its request's ``X-Request-Id`` (``server/request_ids.py``); each scoring request runs under an
OpenTelemetry server span where the package is installed (``server/tracing.py``).

``/health``, ``/metrics`` and the OpenAPI pages stay open when an API key is set (probes and scrapers
carry no key); the scoring routes and ``/v1/models`` need it.
"""

from __future__ import annotations

import gc
import inspect
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from rerankit import __version__
from rerankit.backend import Backend
from rerankit.defaults import DEFAULT_MODEL_PACKAGE
from rerankit.errors import ReplicaDied, RerankitError, UpstreamError, hide_credentials
from rerankit.remote.dialects import get_dialect
from rerankit.remote.dialects.common import openai_error
from rerankit.server.batcher import Batcher
from rerankit.server.limits import ServerConfig, check_api_key
from rerankit.server.metrics import replica_counts
from rerankit.server.request_ids import RequestIds
from rerankit.server.routes import METHODS, ROUTES, default_dialect, error_headers, error_response, scoring_endpoint
from rerankit.server.tracing import Traces

PACKAGED_MODEL_NAME = "all-MiniLM-L6-v2"


def create_app(backend: Backend, config: ServerConfig | None = None) -> FastAPI:
    """An app serving ``backend`` under every dialect's routes; the caller keeps ownership of ``backend``."""
    config = config or ServerConfig()
    batcher = Batcher(backend, config)
    metrics = batcher.metrics
    # A proxy publishes its far server's model, once it knows it (never the far server's URL, if it can help it).
    fixed_name = config.served_model_name or (None if batcher.proxies else public_model_name(backend.model_name))
    learn_name = None if fixed_name else getattr(backend, "aserved_model", None)
    far_problem = getattr(backend, "ahealth", None) if batcher.proxies else None
    engine_problem = None if batcher.proxies else getattr(backend, "problem", None)  # data-parallel replicas
    replicas = None if batcher.proxies else getattr(backend, "replica_status", None)

    def model_name() -> str:
        return fixed_name or public_model_name(backend.model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if config.warm_up:
            await batcher.warm_up()  # before the server accepts connections: /health answers once it is done
        if learn_name is not None:
            await learn_name()  # a proxy's far server's model, if it answers now (else asked again by /v1/models)
        if config.freeze_gc:
            gc.collect()
            gc.freeze()  # what is alive now (weights' modules, compiled code) stays: full collections skip it
        batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="rerankit", version=__version__, lifespan=lifespan, **own_telemetry_only(),
                  description=f"Reranking with {model_name()}: vLLM, SGLang, Cohere and TEI scoring routes.")
    app.state.batcher = batcher  # serve() drains it on SIGTERM/SIGINT
    # every response's X-Request-Id; the id in the routes' logs and forwarded; an error let through: a JSON 500
    app.add_middleware(RequestIds, unhandled=lambda scope, request_id: path_error_response(
        scope.get("path", ""), RerankitError(f"internal server error (request {request_id}: the server's log has "
                                             "its traceback)"), config))
    # outermost: a scoring request's server span sees its final status and X-Request-Id (server/tracing.py)
    app.add_middleware(Traces, paths=ROUTES)

    for path, dialects in ROUTES.items():
        endpoint = scoring_endpoint(path, batcher, config, model_name)
        for method in METHODS.get(path, ("POST",)):
            app.add_api_route(path, endpoint, methods=[method], openapi_extra=request_body(dialects), tags=["scoring"],
                              operation_id=f"{method.lower()}{path.replace('/', '_')}",
                              summary=f"Score or rerank ({' | '.join(dialects)} wire format)")

    @app.get("/health", tags=["server"],
             responses={503: {"description": "no engine replica is ready, or a proxy's far server is unreachable"}})
    async def health() -> JSONResponse:
        """200 while the server can score (``"degraded"`` while some data-parallel replicas are not ready); 503 while
        no engine replica is ready, or a proxy's far server is unreachable (probed every few s)."""
        problem = await far_problem() if far_problem is not None else None
        if problem is not None:
            return app_error_response(UpstreamError(503, problem, None), config)
        problem = engine_problem() if engine_problem is not None else None
        if problem is not None:
            return app_error_response(ReplicaDied(problem), config)
        if replicas is None:
            return JSONResponse({"status": "ok"})
        counts = replica_counts(replicas())
        return JSONResponse({"status": "ok" if counts["ready"] == sum(counts.values()) else "degraded",
                             "replicas": counts})

    @app.get("/v1/models", tags=["server"])
    async def models(request: Request) -> JSONResponse:
        """The one served model, OpenAI-style."""
        check_api_key(config, request.headers.get("authorization"))
        if learn_name is not None:
            await learn_name()
        return JSONResponse({"object": "list", "data": [
            {"id": model_name(), "object": "model", "created": int(time.time()), "owned_by": "rerankit"}]})

    @app.get("/metrics", tags=["server"], response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        """Prometheus text: requests, items, tokens, latency, engine batches, queue depth."""
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.exception_handler(RerankitError)
    async def rerankit_error(request: Request, exc: RerankitError) -> JSONResponse:
        return app_error_response(exc, config)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_json(exc.status_code, str(exc.detail), "http_error", exc.headers)

    return app


def own_telemetry_only() -> dict[str, Any]:
    """FastAPI's arguments that turn its own telemetry off: FastAPI 0.16x records server and operation spans, which
    would stand beside ``Traces``' as a second trace of every request (and of every probe and scrape), and metrics
    and log records, which ``/metrics`` and the server's log already give; with no provider set up they still cost
    ~50-100 us of the event loop a request (2-core CPU, 2026-11-27: 496-502 against 554-578 us a /rerank request
    of a fake backend through httpx's ASGI transport)."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "operation_spans": False, "metrics": False, "logs": False}}


def request_body(dialects: tuple[str, ...]) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of a scoring path: its dialects' request models (``anyOf`` when several), so that
    Swagger's "try it out" and body generators (schemathesis) build bodies the path takes."""
    schemas = [{**get_dialect(name).request_body.model_json_schema(), "title": f"{name} request"} for name in dialects]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def public_model_name(model: str | None) -> str:
    """The name a server publishes for ``model``: a local folder's name, never its path; a hub id as is; a URL
    without its user and password.

    None is the packaged MiniLM (``make_backend``'s default).
    """
    if model is None:
        return PACKAGED_MODEL_NAME
    if model.startswith(("http://", "https://")):
        return hide_credentials(model)
    folder = Path(model)
    if not folder.is_dir():
        return model
    folder = folder.resolve()
    if folder.parent.name == DEFAULT_MODEL_PACKAGE:
        return PACKAGED_MODEL_NAME
    # The hub's cache holds a model at models--<org>--<name>/snapshots/<commit>: the hub id names it.
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.removeprefix("models--").replace("--", "/")
    return folder.name


def path_error_response(path: str, error: RerankitError, config: ServerConfig) -> JSONResponse:
    """``error`` as ``path`` answers its own errors: in its dialect on a scoring path (``routes.default_dialect``),
    rerankit's own body on any other."""
    if path in ROUTES:
        return error_response(default_dialect(path, config), error, config)
    return app_error_response(error, config)


def app_error_response(error: RerankitError, config: ServerConfig) -> JSONResponse:
    """A ``RerankitError`` on a route of no dialect: ``error_json`` with the error's type and ``error_headers``."""
    return error_json(error.status_code, error.message, error.error_type, error_headers(error, config))


def error_json(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """rerankit's own error body (the vLLM/OpenAI shape) for routes that belong to no dialect."""
    return JSONResponse({"error": openai_error(status, message, None, kind)}, status_code=status, headers=headers)
