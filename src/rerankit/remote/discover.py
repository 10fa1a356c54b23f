"""Which dialects a server speaks, read from what it publishes: the paths of ``/openapi.json`` (NVIDIA NIM's
``/v1/ranking`` among them), the owner in ``/v1/models``, TEI's ``/info``; and, for a client told its dialect, only
the served model from ``/v1/models``.
Results are cached per base URL for the life of the process.

The probing is written once, as a generator that yields the path to GET and is sent back the ``Reply``;
``discover`` and ``adiscover`` only drive it with sync or async I/O.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Awaitable, Callable, Generator, Iterable, Sequence

from rerankit.errors import RemoteError
from rerankit.remote.reply import Reply

Route = tuple[str, str]  # (dialect name, path)
Probe = Generator[str, Reply, "Discovery"]

_SGLANG_PATHS = {"/get_model_info", "/get_server_info", "/server_info", "/flush_cache"}
_TEI_PATHS = {"/embed", "/embed_all", "/predict"}
# What each server family offers, best first, when only /v1/models says who it is.
_OWNER_ROUTES: dict[str, tuple[Route, ...]] = {
    "vllm": (("vllm-generative", "/generative_scoring"), ("vllm-score", "/score")),
    "sglang": (("sglang-rerank", "/v1/rerank"), ("sglang-score", "/v1/score")),
}
# Routes a family offers beyond what its paths tell: ``rerankit serve`` speaks SGLang's /v1/score too (its path is
# vLLM's as well), the one route that answers every label's probability and pooled hidden states.
_OWNER_EXTRA_ROUTES: dict[str, tuple[Route, ...]] = {"rerankit": (("sglang-score", "/v1/score"),)}
PROBED = ("/openapi.json", "/v1/models", "/info")


@dataclass(frozen=True)
class Discovery:
    """The routes a server offers, in order of preference, and its served model when it says."""

    routes: tuple[Route, ...]
    model: str | None = None


def routes_from_paths(paths: Iterable[str]) -> list[Route]:
    """Routes from the paths of an OpenAPI document (SGLang and TEI are told apart by their own paths)."""
    paths = set(paths)
    if paths & _SGLANG_PATHS:
        # /v1/rerank first: a request without label ids is better served by it than by a classifier's logits.
        return [route for route in (("sglang-rerank", "/v1/rerank"), ("sglang-score", "/v1/score")) if route[1] in paths]
    if paths & _TEI_PATHS and "/rerank" in paths:
        return [("tei", "/rerank")]
    routes = []
    if "/generative_scoring" in paths:
        routes.append(("vllm-generative", "/generative_scoring"))
    routes += [("vllm-score", path) for path in ("/score", "/v1/score") if path in paths][:1]
    if routes:
        return routes
    routes = [("cohere", path) for path in ("/v2/rerank", "/v1/rerank", "/rerank") if path in paths][:1]
    # NVIDIA NIM: its /v1/models names no owner, so only its published paths tell it apart
    return routes or ([("nim", "/v1/ranking")] if "/v1/ranking" in paths else [])


def _probe() -> Probe:
    spec = yield "/openapi.json"
    paths = spec.body.get("paths") if spec.status == 200 and isinstance(spec.body, dict) else None
    routes = routes_from_paths(paths) if isinstance(paths, dict) else []
    model, owner = _first_model((yield "/v1/models"))
    if not routes:
        routes = list(_OWNER_ROUTES.get(owner or "", ()))
    if routes:
        routes += [route for route in _OWNER_EXTRA_ROUTES.get(owner or "", ()) if route not in routes]
    if not routes:
        info = yield "/info"
        if info.status == 200 and isinstance(info.body, dict) and "reranker" in str(info.body.get("model_type")):
            routes = [("tei", "/rerank")]
            model = model or info.body.get("model_id")
    return Discovery(tuple(routes), model)


def _model_probe() -> Probe:
    model, _ = _first_model((yield "/v1/models"))
    return Discovery((), model)


def _first_model(reply: Reply) -> tuple[str | None, str | None]:
    """Id and owner of the first model of an OpenAI-style ``/v1/models`` list."""
    data = reply.body.get("data") if reply.status == 200 and isinstance(reply.body, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return None, None
    return data[0].get("id"), data[0].get("owned_by")


_cache: dict[str, Discovery] = {}
_model_cache: dict[str, Discovery] = {}
_cache_lock = threading.Lock()


def _found(base_url: str, discovery: Discovery) -> Discovery:
    with _cache_lock:
        _cache[base_url] = discovery
    return discovery


def _found_model(base_url: str, discovery: Discovery) -> Discovery:
    with _cache_lock:
        _model_cache[base_url] = discovery
    return discovery


def _unreachable(base_urls: Sequence[str]) -> RemoteError:
    return RemoteError(f"cannot reach {', '.join(base_urls)} to discover its dialect; is the server up?")


class _Search:
    """One discovery over ``base_urls``, URL after URL: a URL that answers nothing useful (an error status to every
    probe, or paths no dialect has) hands over to the next; the first that shows its routes (its model, for a
    model-only discovery) is the answer. ``discover`` and ``adiscover`` drive each URL's probe and hand its end to
    ``done``."""

    def __init__(self, base_urls: Sequence[str], model_only: bool) -> None:
        self.base_urls = list(base_urls)
        self.model_only = model_only
        self.cache, self.probe_of, self.found = _MODEL_ONLY if model_only else _FULL
        self.statuses: dict[str, list[int]] = {}  # each reachable URL's probe statuses
        self.fallback: tuple[str, Discovery] | None = None  # model-only: the first reachable URL's answer

    def done(self, base_url: str, discovery: Discovery, statuses: list[int]) -> Discovery | None:
        """The answer, once ``base_url``'s probe has ended with ``discovery``; None to go on to the next URL."""
        self.statuses[base_url] = statuses
        if self.model_only:
            if discovery.model is not None:
                return self.found(base_url, discovery)
            self.fallback = self.fallback or (base_url, discovery)
            return None
        return self.found(base_url, discovery) if discovery.routes else None

    def failed(self) -> Discovery:
        """What is left when no URL answered: the first reachable URL's for a model-only discovery, else an error
        saying why (every probe refused with one status, or no dialect found)."""
        if self.fallback is not None:
            return self.found(*self.fallback)
        if not self.statuses:
            raise _unreachable(self.base_urls)
        seen = {status for statuses in self.statuses.values() for status in statuses}
        urls = ", ".join(self.statuses)
        if len(seen) == 1 and (status := seen.pop()) >= 400:
            why = ("check api_key" if status in (401, 403) else
                   "is it still starting? retry later, or pass dialect=" if status in (429, 500, 502, 503, 504) else
                   "pass dialect=")
            raise RemoteError(f"{urls} answered {status} to every discovery probe ({', '.join(PROBED)}): {why}",
                              status)
        raise RemoteError(f"could not tell which dialect {urls} speaks (probed {', '.join(PROBED)}); pass dialect=")


def discover(get: Callable[[str, str], Reply], base_urls: Sequence[str], *, model_only: bool = False) -> Discovery:
    """The routes and model (cached) of the first server that shows them; ``get(base_url, path)`` does the I/O.

    ``model_only``: ask ``/v1/models`` only, for a client that was told its dialect (no routes are then found).
    """
    search = _Search(base_urls, model_only)
    for base_url in base_urls:
        if base_url in search.cache:
            return search.cache[base_url]
        probe, statuses = search.probe_of(), []
        path = next(probe)
        try:
            while (reply := get(base_url, path)).status is not None:
                statuses.append(reply.status)
                path = probe.send(reply)
        except StopIteration as ended:
            if (answer := search.done(base_url, ended.value, statuses)) is not None:
                return answer
    return search.failed()


async def adiscover(aget: Callable[[str, str], Awaitable[Reply]], base_urls: Sequence[str], *,
                    model_only: bool = False) -> Discovery:
    """Async twin of ``discover``."""
    search = _Search(base_urls, model_only)
    for base_url in base_urls:
        if base_url in search.cache:
            return search.cache[base_url]
        probe, statuses = search.probe_of(), []
        path = next(probe)
        try:
            while (reply := await aget(base_url, path)).status is not None:
                statuses.append(reply.status)
                path = probe.send(reply)
        except StopIteration as ended:
            if (answer := search.done(base_url, ended.value, statuses)) is not None:
                return answer
    return search.failed()


# (cache, probe, what records a result) of a full discovery and of a served-model one.
_FULL = (_cache, _probe, _found)
_MODEL_ONLY = (_model_cache, _model_probe, _found_model)


def forget(base_url: str | None = None) -> None:
    """Drop the cached discovery of ``base_url`` (of every URL when None), e.g. after a server changed."""
    with _cache_lock:
        for cache in (_cache, _model_cache):
            if base_url is None:
                cache.clear()
            else:
                cache.pop(base_url.rstrip("/"), None)
