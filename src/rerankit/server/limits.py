"""What ``rerankit serve`` is told at start (``ServerConfig``), and the per-request limits it enforces."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from rerankit.errors import RequestTooLarge, Unauthorized
from rerankit.request_ids import usable_request_id
from rerankit.schema import ScoreRequest

# The dialects that answer /rerank, /v1/rerank or /v2/rerank (rerankit.server.routes.ROUTES).
RERANK_DIALECTS = ("vllm-rerank", "tei", "infinity", "sglang-rerank", "cohere", "jina", "voyage")


@dataclass(frozen=True)
class ServerConfig:
    """Server settings, built once and passed down to the app, the routes and the batcher.

    Batching: requests waiting while the engine runs are merged into one engine call of at most
    ``max_batch_items`` items and about ``max_batch_tokens`` tokens; ``batching=False`` scores one
    request per engine call (to measure what batching buys). ``warm_up``: before answering, run a backend's
    ``warm_up()`` (the embedded engine) over every shape of call the batcher forms (``batcher.warm_up_shapes``; on
    a CPU, where no shape costs more the first time, two synthetic requests), and on a GPU over every graph shape
    too (``engine/warm_up.py``), so that the first clients do not wait for compiling or CUDA graph captures. ``freeze_gc``: once warmed up, move every object alive to Python's permanent generation
    (``gc.freeze()``), so that later full collections skip the model's and the compiler's objects. On an H100
    with the Qwen3-0.6B shape loaded, compiled and captured, 628k objects were tracked and one full collection took
    309 ms, a stall that any request could meet; ``rerankit serve`` sets it, as it owns its process.
    ``rerank_dialect``: the dialect that answers a rerank body which shows none (see ``rerankit.server.routes``).

    Scheduling (``server/scheduler.py``): a request is cut into chunks of at most ``max_chunk_tokens`` estimated
    tokens, and an engine call takes one chunk of each waiting request: the lowest priority first, then the
    least-served caller and request. A request's caller (``caller_of``) is the value of its ``caller_header`` where
    the server names one and the request sends it, else the key it gave where the server takes several, else its
    client's address. ``max_request_tokens``
    bounds one request's estimated tokens after truncation (413 above it). ``drain_seconds``: on SIGTERM/SIGINT the
    server refuses new work (503) and gives the work in progress this long before answering it 503.

    Connections (``rerankit serve`` only, ``server/connections.py``): a connection opened while ``max_connections``
    are open gets one JSON 503; a connection whose request headers are not complete ``header_timeout_s`` after it
    opened (over HTTPS, was accepted: its TLS handshake spends the same time) or after its last response is closed;
    an idle keep-alive connection is closed after ``keep_alive_timeout_s``. A request body not whole
    ``body_timeout_s`` after the route starts reading it is answered 408 and its connection closed (a client
    dripping a body cannot hold a connection).
    """

    api_key: str | tuple[str, ...] | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_items_per_request: int = 1024
    max_tokens_per_item: int = 8192
    max_queue_requests: int = 256
    max_batch_items: int = 512
    max_batch_tokens: int = 131072
    batch_window_ms: float = 5.0
    batching: bool = True
    max_request_tokens: int = 262144
    max_chunk_tokens: int = 8192
    drain_seconds: float = 10.0
    retry_after_s: int = 1
    warm_up: bool = True
    freeze_gc: bool = False
    rerank_dialect: str | None = None
    caller_header: str | None = None
    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_items_per_request", "max_tokens_per_item", "max_queue_requests",
                     "max_batch_items", "max_batch_tokens", "max_request_tokens", "max_chunk_tokens",
                     "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("batch_window_ms", "keep_alive_timeout_s", "drain_seconds"):
            if not getattr(self, name) >= 0:  # also refuses nan
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.rerank_dialect is not None and self.rerank_dialect not in RERANK_DIALECTS:
            raise ValueError(f"rerank_dialect must be one of {', '.join(RERANK_DIALECTS)}, got {self.rerank_dialect!r}")


def caller_of(config: ServerConfig, headers: Mapping[str, str], key_index: int | None, client: str | None) -> str:
    """Whose request this is, for the fair shares: ``caller_header``'s value (1-128 visible ASCII characters),
    else the API key given where the server takes several (by its position: no key is kept), else the client's
    address."""
    if config.caller_header:
        named = usable_request_id(headers.get(config.caller_header))
        if named is not None:
            return f"header:{named}"
    if key_index is not None and len(api_keys(config)) > 1:
        return f"key:{key_index}"
    return f"client:{client or ''}"


def api_keys(config: ServerConfig) -> tuple[str, ...]:
    """The keys the server takes (``api_key``: one, or several while a key is rotated); none: no key needed."""
    keys = (config.api_key,) if isinstance(config.api_key, str) else tuple(config.api_key or ())
    return tuple(key for key in keys if key)


def check_api_key(config: ServerConfig, authorization: str | None) -> int | None:
    """Raise ``Unauthorized`` unless the server takes no key or ``Authorization: Bearer <key>`` gives one of its;
    the position of the key given among the server's (None: the server takes no key)."""
    keys = api_keys(config)
    if not keys:
        return None
    scheme, _, given = (authorization or "").partition(" ")
    # compare_digest against every key: the time taken must tell neither how many leading characters were right
    # nor which key came close.
    matches = [hmac.compare_digest(given.strip().encode(), key.encode()) for key in keys]
    if scheme.lower() != "bearer" or not any(matches):
        raise Unauthorized("missing or wrong API key: send 'Authorization: Bearer <key>'")
    return matches.index(True)


def check_body_size(config: ServerConfig, size: int) -> None:
    """Raise ``RequestTooLarge`` (413) for a body over ``max_body_bytes``."""
    if size > config.max_body_bytes:
        raise RequestTooLarge("body", f"is over {config.max_body_bytes} bytes (max_body_bytes)",
                              config.max_body_bytes)


def bound_request(config: ServerConfig, request: ScoreRequest, cut_items: bool = True) -> ScoreRequest:
    """The request within the server's limits: too many items is a 413; items are cut to ``max_tokens_per_item``.

    The token limit becomes the request's own cut (the lower of the two), so the engine cuts long items
    where the request allows it and refuses them (``InvalidRequest``) where it says ``truncation="none"``.
    ``cut_items=False`` (a proxy): the request keeps its own cut, or none; the far server cuts by its own limit
    (most peers' routes take no per-item cut, and would refuse every request that carried the server's).
    """
    if len(request.items) > config.max_items_per_request:
        raise RequestTooLarge("items", f"holds {len(request.items)} items; the limit is "
                              f"{config.max_items_per_request} (max_items_per_request)",
                              config.max_items_per_request)
    limit = config.max_tokens_per_item
    if not cut_items or (request.max_tokens_per_item is not None and request.max_tokens_per_item <= limit):
        return request
    return request.model_copy(update={"max_tokens_per_item": limit})
