"""``RemoteBackend``: the ``Backend`` that scores through a server, gluing a dialect to the transport.

A request is checked and encoded before any I/O (a refused field never reaches the wire), split into
requests of at most ``max_items_per_request`` items, sent concurrently, and reassembled in input order.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import httpx

from rerankit.errors import InvalidRequest, RerankitError, hide_credentials
from rerankit.remote.client import (DEFAULT_DEADLINE, DEFAULT_MAX_RESPONSE_BYTES, ClientConfig, Timeout, Transport,
                                    check_count, check_seconds)
from rerankit.remote.deadline import Deadline
from rerankit.remote.dialects import Dialect, get_dialect
from rerankit.remote.discover import Discovery, adiscover, discover
from rerankit.remote.health import FarHealth
from rerankit.schema import ScoreRequest, ScoreResponse


class RemoteBackend:
    """Scores on a remote server: vLLM, SGLang, a Cohere-style or TEI ``/rerank`` server, or ``rerankit serve``.

    ``urls``: one server root URL or several serving the same model (round-robin, failover).
    ``dialect``: one of ``rerankit.remote.dialects.DIALECTS``; discovered from the server when None.
    ``served_model``: the server's model, sent as the body's ``model`` where the dialect has one (Cohere requires
    it); when None, the first model of the server's ``/v1/models`` (none sent if it lists none).
    ``path``: post there instead of the dialect's default route (e.g. ``/v1/rerank`` for Cohere's v1 API).
    ``deadline``: seconds a whole call may take, every try and endpoint included (None: no bound).
    ``timeout``: a ``Timeout``, or the seconds one try may take. Other options: see ``ClientConfig``.
    """

    def __init__(self, urls: str | Sequence[str], *, dialect: str | None = None, served_model: str | None = None,
                 api_key: str | None = None, path: str | None = None, timeout: Timeout | float = Timeout(),
                 max_retries: int = 3, backoff_base: float = 0.25, backoff_max: float = 10.0,
                 max_items_per_request: int | None = None, max_concurrency: int = 8, dead_cooldown: float = 30.0,
                 deadline: float | None = DEFAULT_DEADLINE, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
                 transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None) -> None:
        url_list = [urls] if isinstance(urls, str) else list(urls)
        for number, url in enumerate(url_list):
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise InvalidRequest("urls", f"{hide_credentials(repr(url))} is not an http(s) URL")
            if any(character.isspace() for character in url):  # not echoed: its password may hold the space
                raise InvalidRequest("urls", f"URL {number} holds whitespace: percent-encode it (%20)")
        if path is not None and (dialect is None or not path.startswith("/")):
            raise InvalidRequest("path", "give a path starting with '/', together with dialect=")
        if max_items_per_request is not None:
            check_count("max_items_per_request", max_items_per_request, 1)
        if api_key is not None and not (isinstance(api_key, str) and api_key.isascii()):
            raise InvalidRequest("api_key", "must be ASCII text: it travels in an HTTP header")
        if not isinstance(timeout, Timeout):
            check_seconds("timeout", timeout)
            timeout = Timeout(connect=min(Timeout.connect, timeout), read=timeout)
        config = ClientConfig(timeout=timeout, max_retries=max_retries, backoff_base=backoff_base,
                              backoff_max=backoff_max, max_concurrency=max_concurrency, dead_cooldown=dead_cooldown,
                              deadline=deadline, max_response_bytes=max_response_bytes)
        self._dialect = get_dialect(dialect) if dialect is not None else None
        self._path = path
        self._model = served_model
        self._max_items = max_items_per_request
        self._discovery: Discovery | None = None
        self._served_model: str | None = None
        self.transport = Transport(url_list, config, api_key, transport)
        self.far_health = FarHealth(self.transport)

    @property
    def model_name(self) -> str:
        """The model given, else the one the server named (after discovery or a response), else the URL."""
        return self._model or self._served_model or self.transport.endpoints.urls[0]

    @property
    def max_concurrency(self) -> int:
        """Requests this backend sends at once: a server in front of it keeps this many calls in flight."""
        return self.transport.config.max_concurrency

    def score(self, request: ScoreRequest) -> ScoreResponse:
        """Score on the server within the deadline; one result per item, in input order."""
        deadline = self.transport.deadline()
        if self._discovery is None and (self._dialect is None or self._model_unknown(request)):
            with self.transport.stoppable() as stop:  # close() ends a wait for a server still starting
                self._learn(discover(partial(self.transport.get, deadline=deadline, stop=stop),
                                     self.transport.endpoints.order(), model_only=self._dialect is not None,
                                     config=self.transport.config, deadline=deadline, stop=stop))
        dialect, path, chunks, bodies = self._encode(request)
        return self._decode(dialect, chunks, self.transport.post_all(path, bodies, deadline))

    async def ascore(self, request: ScoreRequest) -> ScoreResponse:
        """Async twin of ``score``."""
        deadline = self.transport.deadline()
        if self._discovery is None and (self._dialect is None or self._model_unknown(request)):
            with self.transport.stoppable() as stop:  # close(), from any thread, ends a wait for a starting server
                get = partial(self.transport.aget, deadline=deadline)
                self._learn(await adiscover(get, self.transport.endpoints.order(),
                                            model_only=self._dialect is not None, config=self.transport.config,
                                            deadline=deadline, stop=stop))
        dialect, path, chunks, bodies = self._encode(request)
        return self._decode(dialect, chunks, await self.transport.apost_all(path, bodies, deadline))

    async def aserved_model(self, seconds: float = 2.0) -> str | None:
        """The server's model: the one given or learnt, else the first of its ``/v1/models``, asked now within
        ``seconds``, once, without waiting for a starting server (a server that lists none is not asked again; one
        that could not answer is, next time); None when nothing names it."""
        if self._model is None and self._served_model is None:
            get = partial(self.transport.aget, deadline=Deadline(seconds))
            try:
                with self.transport.stoppable() as stop:
                    found = await adiscover(get, self.transport.endpoints.order(), model_only=True, stop=stop)
            except RerankitError:  # unreachable, too slow (asked again next time), or the backend closed
                return None
            self._served_model = found.model
        return self._model or self._served_model

    async def ahealth(self) -> str | None:
        """None while the server can take requests (one just succeeded, or a recent probe of its ``/health`` was
        answered); else what is wrong, naming its URL without credentials (see ``rerankit.remote.health``)."""
        return await self.far_health.problem()

    def close(self) -> None:
        """Close the connection pools. A call running, sync or async, in this thread, another one or on any event
        loop (waiting for a server still starting, between tries, or reading) ends at once with ``Cancelled``; so
        does a call begun after."""
        self.transport.close()

    async def aclose(self) -> None:
        """``close``, awaiting the async pool of the running loop."""
        await self.transport.aclose()

    def __enter__(self) -> "RemoteBackend":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> "RemoteBackend":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _model_unknown(self, request: ScoreRequest) -> bool:
        """True when the given dialect requires a model and none was given: it is then read from ``/v1/models``,
        after the request is checked (a refused field never costs a request)."""
        if self._dialect is None or self._model is not None or not self._dialect.requires_model:
            return False
        self._dialect.encode_request(request, None)
        return True

    def _learn(self, discovery: Discovery) -> None:
        self._discovery = discovery
        self._served_model = self._served_model or discovery.model

    @property
    def _wire_model(self) -> str | None:
        return self._model or (self._discovery.model if self._discovery else None)

    def _route(self, request: ScoreRequest) -> tuple[Dialect, str]:
        """The dialect and path for ``request``: the one given, else the first discovered that accepts it."""
        if self._dialect is not None:
            return self._dialect, self._path or self._dialect.paths[0]
        assert self._discovery is not None
        refusals = []
        for name, path in self._discovery.routes:
            dialect = get_dialect(name)
            try:
                dialect.encode_request(request, self._wire_model)
            except InvalidRequest as exc:
                refusals.append(exc)
                continue
            return dialect, path
        raise refusals[0]

    def _encode(self, request: ScoreRequest) -> tuple[Dialect, str, list[ScoreRequest], list[dict[str, Any]]]:
        dialect, path = self._route(request)
        chunks = split_items(request, self._max_items or dialect.max_items)
        bodies = [dialect.encode_request(chunk, self._wire_model)[1] for chunk in chunks]
        return dialect, path, chunks, bodies

    def _decode(self, dialect: Dialect, chunks: list[ScoreRequest], replies: list[Any]) -> ScoreResponse:
        # Learnt only from a reply that names it: one that does not (TEI, SGLang's /v1/rerank) is decoded with
        # model_name, which may be the URL.
        named = [reply.get("model") for reply in replies if isinstance(reply, dict)]
        self._served_model = self._served_model or next((name for name in named if isinstance(name, str) and name),
                                                        None)
        return merge_responses([dialect.decode(reply, chunk, self.model_name) for chunk, reply in zip(chunks, replies)])


def split_items(request: ScoreRequest, max_items: int) -> list[ScoreRequest]:
    """The request cut into requests of at most ``max_items`` consecutive items."""
    return [request.with_items(start, start + max_items) for start in range(0, max(len(request.items), 1), max_items)]


def merge_responses(parts: list[ScoreResponse]) -> ScoreResponse:
    """The responses of consecutive chunks as one, indices offset back to the whole request's."""
    starts = [0]
    for part in parts[:-1]:
        starts.append(starts[-1] + len(part.results))
    return ScoreResponse.joined(list(zip(starts, parts)))
