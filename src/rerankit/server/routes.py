"""The scoring routes: one per wire path, each thin: read the body, parse with the dialect, batch, encode.

A path that several dialects share answers each body in the dialect that the body shows, as peers ignore
fields they do not know and so bodies cannot be told apart by their fields alone:

1. the SDK's header: the ``cohere`` SDKs (v1 ``Client``, ``ClientV2``, and what builds on them: langchain-cohere,
   LlamaIndex's Cohere postprocessor) send ``X-Fern-SDK-Name: cohere``;
2. else the fields that show a dialect (``Dialect.markers``), present and not null: the dialect whose markers
   claim the most fields that no other dialect of the path names answers the body, then the one whose markers
   claim the most fields (a tie goes to the default if it is tied, else to the path's order). So
   ``rank_fields``/``max_chunks_per_doc`` are Cohere v1's and ``top_k``/``truncation`` Voyage's whatever else the
   body holds (``return_documents`` too), ``raw_scores`` Infinity's (with ``texts`` TEI's), ``instruct`` or
   ``return_documents`` alone SGLang's, ``return_documents`` with ``model`` Jina's (a body Cohere's v1 API takes
   too: without the SDK's header or a field of Cohere's alone, it is answered as Jina answers),
   ``truncate_prompt_tokens``, ``padding``... vLLM's, ``queries``/``text_1`` on ``/v1/score`` vLLM's and
   ``query``/``label_token_ids`` there SGLang's;
3. else (a bare ``query``, ``documents``, maybe ``model`` and ``top_n``: truly ambiguous) the default: the server's
   ``rerank_dialect`` where the path speaks it (``rerankit serve --rerank-dialect``), else the path's first.

Errors found before the body is parsed (auth, content type, size, JSON) are in the path's default dialect's format.
A failed request's log line names its request id (``X-Request-Id``, set by ``server/request_ids.py``).

A proxy (``rerankit serve --model http://...``) answers what its far server refused as that server did (its status,
message and field) where the fault is the request's (400, 413, 422) or the far server is busy (429, 503, with the
far server's ``Retry-After`` where it sent one), and 502 otherwise; a field the far server's dialect cannot carry is
named as the client's body calls it.
"""

from __future__ import annotations

import asyncio
import email.message
import json
import logging
import math
import re
import time
from typing import Any, Awaitable, Callable, Mapping

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from rerankit import tracing
from rerankit.errors import (BodyTimeout, Cancelled, InvalidRequest, RemoteError, RerankitError, ShuttingDown,
                             Unauthorized, UnsupportedMediaType, UpstreamError)
from rerankit.remote.dialects import Dialect, get_dialect
from rerankit.request_ids import REQUEST_ID
from rerankit.schema import is_valid_text
from rerankit.server.batcher import Batcher
from rerankit.server.disconnect import unless, unless_disconnected
from rerankit.server.limits import ServerConfig, bound_request, caller_of, check_api_key, check_body_size

log = logging.getLogger("rerankit.server")

# Each scoring path and the dialects that speak it, in the order they are tried.
ROUTES: dict[str, tuple[str, ...]] = {
    "/generative_scoring": ("vllm-generative",),
    "/score": ("vllm-score",),
    "/v1/score": ("sglang-score", "vllm-score"),
    "/rerank": ("vllm-rerank", "tei", "infinity"),
    "/v1/rerank": ("vllm-rerank", "sglang-rerank", "cohere", "jina", "infinity", "voyage"),
    "/v2/rerank": ("cohere", "vllm-rerank"),
    "/v1/ranking": ("nim",),
    "/ranking": ("nim",),
}
# Header -> value -> dialect, for SDKs that say who they are.
SDK_HEADERS = {"x-fern-sdk-name": {"cohere": "cohere"}}
METHODS: dict[str, tuple[str, ...]] = {"/v1/rerank": ("POST", "PUT")}  # SGLang takes PUT there too
# A far server's statuses that a proxy passes on: the request's fault, or the far server busy (with Retry-After).
PASSED_ON = frozenset({400, 413, 422, 429, 503})
# The range of a far server's Retry-After that a proxy passes on (whole seconds, as HTTP writes them).
RETRY_AFTER_RANGE_S = (1, 3600)


def scoring_endpoint(path: str, batcher: Batcher, config: ServerConfig,
                     model_name: Callable[[], str]) -> Callable[[Request], Awaitable[JSONResponse]]:
    """The handler of one scoring path; ``model_name()`` is the name replies give (it may change: a proxy learns
    its far server's)."""
    dialects = [get_dialect(name).at(path) for name in ROUTES[path]]
    default = default_dialect(path, config)
    metrics = batcher.metrics

    async def endpoint(request: Request) -> Response:
        started = time.perf_counter()
        dialect, status, items, tokens, forwarded, parsed = default, 500, 0, 0, False, False
        try:
            key_index = check_api_key(config, request.headers.get("authorization"))
            batcher.admit()  # a full queue or a drain refuses before the body is read, parsed and checked
            body = parse_json(await read_body(request, config, batcher.refusing))
            dialect = dialect_for(dialects, body, request.headers, default)
            score_request = dialect.parse_request(body)
            parsed = True  # from here on an error names a ScoreRequest field, which the reply names as the body does
            asked = bound_request(config, dialect.engine_request(score_request), cut_items=not batcher.proxies)
            forwarded = batcher.proxies
            caller = caller_of(config, request.headers, key_index, request.client.host if request.client else None)
            response = await unless_disconnected(request.receive, batcher.submit(asked, caller))
            payload = dialect.encode_response(response, score_request, model_name(),
                                             dialect.echoed_documents(body))
            status, items, tokens = 200, len(response.results), response.usage.prompt_tokens
            return JSONResponse(payload)
        except (Cancelled, ClientDisconnect):  # the client left (mid-body, or while queued): nobody reads an answer
            status = Cancelled.status_code
            return Response(status_code=status)
        except RerankitError as exc:
            error = proxied_error(exc, dialect) if forwarded else wire_named(exc, dialect) if parsed else exc
            status = error.status_code
            if status == 502:
                log.warning("proxied request %s on %s failed: %s", REQUEST_ID.get(), path, exc.message)
            return error_response(dialect, error, config)
        except Exception:  # a bug or an engine failure: logged, answered in the dialect's format, server lives on
            log.exception("scoring request %s on %s failed", REQUEST_ID.get(), path)
            return JSONResponse(dialect.error_body(500, "internal server error"), status_code=500)
        finally:
            if status == Cancelled.status_code:
                metrics.observe_cancelled()
            else:
                metrics.observe_request(path, status, time.perf_counter() - started, items, tokens)
            tracing.set_attributes(dialect=dialect.name, model=model_name(), items=items if status == 200 else None,
                                   prompt_tokens=tokens if status == 200 else None)

    return endpoint


def dialect_for(dialects: list[Dialect], body: Any, headers: Mapping[str, str] | None = None,
                default: Dialect | None = None) -> Dialect:
    """The dialect that answers ``body`` on a path shared by ``dialects``: by the SDK's header, else by the
    fields only one dialect has, else ``default`` (the path's first when None); see the module's docstring."""
    default = default or dialects[0]
    for header, named in SDK_HEADERS.items():
        name = named.get(((headers or {}).get(header) or "").strip().lower())
        sdk_dialect = next((dialect for dialect in dialects if dialect.name == name), None)
        if sdk_dialect is not None:
            return sdk_dialect
    present = {field for field, value in body.items() if value is not None} if isinstance(body, dict) else set()
    weights = {}
    for dialect in dialects:
        claimed = dialect.claimed(present)
        # a field that only this dialect's markers name on the path outweighs any number of shared ones
        shared = set().union(*(marker for other in dialects if other is not dialect for marker in other.markers))
        weights[dialect.name] = (len(claimed - shared), len(claimed))
    best = max(weights.values())
    if best == (0, 0) or weights[default.name] == best:
        return default
    return next(dialect for dialect in dialects if weights[dialect.name] == best)


async def read_body(request: Request, config: ServerConfig, refusing: asyncio.Event | None = None) -> bytes:
    """The request body: refused (415) unless declared JSON, (413) as soon as it passes ``max_body_bytes``, (408)
    unless it is whole within ``body_timeout_s``, and (503) as soon as ``refusing`` is set (the server drains for
    shutdown: the request would be refused once read, and uvicorn cancels, with a plain-text 500, a body still
    arriving after the drain)."""
    check_json_content_type(request.headers.get("content-type"))
    check_identity_encoding(request.headers.get("content-encoding"))
    declared = request.headers.get("content-length", "")
    if declared.isdigit():
        check_body_size(config, int(declared))

    async def whole() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            check_body_size(config, size)
            chunks.append(chunk)
        return b"".join(chunks)

    reading = asyncio.wait_for(whole(), config.body_timeout_s)
    try:
        if refusing is None:
            return await reading
        return await unless(reading, refusing.wait(),
                            lambda: ShuttingDown("the server is shutting down and takes no new requests"))
    except asyncio.TimeoutError:
        raise BodyTimeout("body", f"did not arrive whole within {config.body_timeout_s:g} s "
                                  "(body_timeout_s)") from None


def check_json_content_type(content_type: str | None) -> None:
    """Raise ``UnsupportedMediaType`` unless ``content_type`` is ``application/json`` or ``application/*+json``.

    A browser posts ``text/plain``, form and typeless bodies cross-site without asking the server first (no CORS
    preflight); refusing them keeps any web page from scoring on a server without a key. FastAPI (so vLLM) parses
    the same types as JSON and no others; httpx, requests and the Cohere SDK send ``application/json``.
    """
    declared = email.message.Message()
    declared["content-type"] = content_type or ""
    subtype = declared.get_content_subtype()
    if not content_type or declared.get_content_maintype() != "application" or not (
            subtype == "json" or subtype.endswith("+json")):
        raise UnsupportedMediaType("Content-Type", f"must be application/json, got {content_type or 'none'!r}")


def check_identity_encoding(content_encoding: str | None) -> None:
    """Raise ``UnsupportedMediaType`` for a compressed body (``Content-Encoding`` other than ``identity``): it is
    not decoded, and would otherwise be refused as bad UTF-8."""
    codings = [coding.strip().lower() for coding in (content_encoding or "").split(",") if coding.strip()]
    if any(coding != "identity" for coding in codings):
        raise UnsupportedMediaType("Content-Encoding", f"{content_encoding!r} is not accepted; send the body "
                                   "uncompressed")


def parse_json(raw: bytes) -> Any:
    """A JSON body as Python values; bad UTF-8 (lone surrogates too), NaN/Infinity, bad JSON: ``InvalidRequest``."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError as exc:
        raise InvalidRequest("body", f"is not valid UTF-8 (byte {exc.start})") from None
    except RecursionError:
        raise InvalidRequest("body", "nests too deeply") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, integers of more than 4300 digits
        raise InvalidRequest("body", f"is not valid JSON: {exc}") from None
    _check_texts(body)
    return body


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _check_texts(value: Any) -> None:
    """Refuse texts holding lone surrogates (``"\\ud800"`` is valid JSON but not encodable text)."""
    stack = [value]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if not is_valid_text(value):
                raise InvalidRequest("body", "holds a lone UTF-16 surrogate escape: not valid text")
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def default_dialect(path: str, config: ServerConfig) -> Dialect:
    """The dialect of ``path``'s errors before its body is parsed: the server's ``rerank_dialect`` where ``path``
    speaks it, else the path's first."""
    dialects = [get_dialect(name).at(path) for name in ROUTES[path]]
    return next((dialect for dialect in dialects if dialect.name == config.rerank_dialect), dialects[0])


def error_response(dialect: Dialect, error: RerankitError, config: ServerConfig) -> JSONResponse:
    """The error in ``dialect``'s format with the error's status and ``error_headers``."""
    param = getattr(error, "field", None)
    return JSONResponse(dialect.error_body(error.status_code, error.message, param), status_code=error.status_code,
                        headers=error_headers(error, config))


def proxied_error(error: RerankitError, dialect: Dialect) -> RerankitError:
    """The error of a request a proxy forwarded, as its client is answered.

    A far server's refusal (400, 413, 422) or busy status (429, 503) keeps its status, message and field, without
    the far server's URL; any other (its API key, a wrong path, its own failure, no answer) is the proxy's fault:
    502, with what went wrong. A field is named as ``dialect``'s bodies name it (``items`` are Cohere's
    ``documents``), whether the far server refused it or its dialect cannot carry it.
    """
    if isinstance(error, RemoteError):
        if error.status_code not in PASSED_ON:
            return UpstreamError(502, error.message, None)
        message = error.reason
        head, colon, rest = message.partition(": ")
        if colon and head == (error.field or head):  # the message leads with its field (rerankit's, in any dialect)
            message = f"{wire_field(head, dialect)}: {rest}"
        return UpstreamError(error.status_code, message, wire_field(error.field, dialect), error.retry_after)
    return wire_named(error, dialect)


def wire_named(error: RerankitError, dialect: Dialect) -> RerankitError:
    """An ``InvalidRequest`` naming a ``ScoreRequest`` field (``items[3]``) as a copy naming it as ``dialect``'s
    bodies do (``documents[3]``); any other error as it is."""
    if isinstance(error, InvalidRequest) and wire_field(error.field, dialect) != error.field:
        return error.renamed(wire_field(error.field, dialect))
    return error


def wire_field(field: str | None, dialect: Dialect) -> str | None:
    """A ``ScoreRequest`` field (``items[3]``, ``max_tokens_per_item``) as ``dialect``'s bodies name it; anything
    else as it is."""
    root = re.match(r"[A-Za-z_]+(?=$|[.\[])", field or "")
    wire = dialect.wire_names.get(root.group()) if root else None
    return field if root is None or wire is None else wire + field[root.end():]


def error_headers(error: RerankitError, config: ServerConfig) -> dict[str, str]:
    """The headers an error's status calls for: 429 and 503 tell when to retry (whichever error it is: a full queue,
    a drain, a replica that died, a remote server's 429 or 503 passed on), 401 how to log in."""
    headers = {}
    if error.status_code in (429, 503):
        headers["Retry-After"] = str(retry_after_seconds(getattr(error, "retry_after", None), config))
    if isinstance(error, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(error, (BodyTimeout, ShuttingDown)):  # the rest of the body may still come; or the server stops
        headers["Connection"] = "close"
    return headers


def retry_after_seconds(far: float | None, config: ServerConfig) -> int:
    """The ``Retry-After`` of a 429 or 503: the far server's (``far``, seconds), rounded up and kept within
    ``RETRY_AFTER_RANGE_S``, where it sent one; else the server's own ``retry_after_s``."""
    if far is None or not math.isfinite(far):
        return config.retry_after_s
    low, high = RETRY_AFTER_RANGE_S
    return max(low, min(high, math.ceil(min(far, high))))
