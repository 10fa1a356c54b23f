"""The scoring routes: one per wire path, each thin: read the body, parse with the dialect, batch, encode.

A path that several dialects share (``/v1/score``, ``/rerank``, ``/v1/rerank``, ``/v2/rerank``) is decided by
the body's shape: the first dialect listed for the path whose parser accepts the body answers it. The wire
models refuse unknown fields, so the fields a body carries pick its dialect: ``/v1/score`` with ``query`` +
``items`` is SGLang's, with ``queries``/``text_1``/``data_1`` vLLM's (deprecated) one; ``/rerank`` with
``texts`` is TEI's; ``/v1/rerank`` with ``return_documents`` or ``instruct`` is SGLang's (a body that also has
``model`` is Jina/Cohere-style). When no dialect accepts the body, the first one's error answers it, and
errors found before the body is read (auth, size, JSON) are in the first dialect's format too.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse

from rerankit.errors import InvalidRequest, Overloaded, RerankitError
from rerankit.remote.dialects import get_dialect
from rerankit.remote.dialects.common import Dialect
from rerankit.server.batcher import Batcher
from rerankit.server.limits import ServerConfig, Unauthorized, bound_request, check_api_key, check_body_size

log = logging.getLogger("rerankit.server")

# Each scoring path and the dialects that speak it, in the order they are tried.
ROUTES: dict[str, tuple[str, ...]] = {
    "/generative_scoring": ("vllm-generative",),
    "/score": ("vllm-score",),
    "/v1/score": ("sglang-score", "vllm-score"),
    "/rerank": ("vllm-rerank", "tei"),
    "/v1/rerank": ("vllm-rerank", "sglang-rerank", "cohere"),
    "/v2/rerank": ("cohere", "vllm-rerank"),
}
METHODS: dict[str, tuple[str, ...]] = {"/v1/rerank": ("POST", "PUT")}  # SGLang takes PUT there too


def scoring_endpoint(path: str, batcher: Batcher, config: ServerConfig,
                     model_name: str) -> Callable[[Request], Awaitable[JSONResponse]]:
    """The handler of one scoring path."""
    dialects = [get_dialect(name) for name in ROUTES[path]]
    metrics = batcher.metrics

    async def endpoint(request: Request) -> JSONResponse:
        started = time.perf_counter()
        dialect, status, items, tokens = dialects[0], 500, 0, 0
        try:
            check_api_key(config, request.headers.get("authorization"))
            body = parse_json(await read_body(request, config))
            dialect, score_request = parse_with_first_fit(dialects, body)
            score_request = bound_request(config, score_request)
            response = await batcher.submit(score_request)
            payload = dialect.encode_response(response, score_request, model_name, dialect.documents_requested(body))
            status, items, tokens = 200, len(response.results), response.usage.prompt_tokens
            return JSONResponse(payload)
        except RerankitError as exc:
            status = exc.status_code
            return error_response(dialect, exc, config)
        except Exception:  # a bug or an engine failure: logged, answered in the dialect's format, server lives on
            log.exception("scoring request on %s failed", path)
            return JSONResponse(dialect.error_body(500, "internal server error"), status_code=500)
        finally:
            metrics.observe_request(path, status, time.perf_counter() - started, items, tokens)

    return endpoint


def parse_with_first_fit(dialects: list[Dialect], body: Any) -> tuple[Dialect, Any]:
    """The first dialect whose parser accepts ``body``, with the ``ScoreRequest``; else the first one's error."""
    first_error: InvalidRequest | None = None
    for dialect in dialects:
        try:
            return dialect, dialect.parse_request(body)
        except InvalidRequest as exc:
            first_error = first_error or exc
    assert first_error is not None
    raise first_error


async def read_body(request: Request, config: ServerConfig) -> bytes:
    """The request body, refused (413) as soon as it passes ``max_body_bytes``, declared or streamed."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit():
        check_body_size(config, int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        check_body_size(config, size)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    """A JSON body as Python values; bad UTF-8 (lone surrogates included), NaN/Infinity, bad JSON: ``InvalidRequest``."""
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
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequest("body", "holds a lone UTF-16 surrogate escape: not valid text") from None
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def error_response(dialect: Dialect, error: RerankitError, config: ServerConfig) -> JSONResponse:
    """The error in ``dialect``'s format with the error's status; 429 tells when to retry, 401 how to log in."""
    param = getattr(error, "field", None)
    headers = {}
    if isinstance(error, Overloaded):
        headers["Retry-After"] = str(config.retry_after_s)
    if isinstance(error, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(dialect.error_body(error.status_code, error.message, param), status_code=error.status_code,
                        headers=headers)
