"""Which dialects a server speaks, read from what it publishes: the paths of ``/openapi.json`` (NVIDIA NIM's
``/v1/ranking`` among them), the owner in ``/v1/models``, TEI's ``/info``; and, for a client told its dialect, only
the served model from ``/v1/models``.

A server that answers as one still starting does (no connection, 429 or 5xx) is asked again as a scoring call's
tries are: after the config's backoff or its ``Retry-After``, up to ``max_retries`` times, within the call's
deadline; a definite answer (401, 403, 404, paths no dialect has) is not waited for. Results are cached per base
URL for the life of the process, but never one read while a probe got a starting server's answer or a 401 or 403.

The search is written once, as generators: a probe yields the path to GET and is sent back the ``Reply``; the
search yields (base URL, path) to GET, or the seconds to wait before the next round. ``discover`` and ``adiscover``
only drive it with sync or async I/O.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Generator, Iterable, Optional, Sequence, Union

from rerankit.errors import RemoteError
from rerankit.remote.closing import Stop
from rerankit.remote.deadline import Deadline
from rerankit.remote.reply import Reply

if TYPE_CHECKING:
    from rerankit.remote.client import ClientConfig

Route = tuple[str, str]  # (dialect name, path)
Probe = Generator[str, Reply, "Discovery"]
Step = Union[tuple[str, str], float]  # what the search asks for: a (base URL, path) to GET, or seconds to wait
Search = Generator[Step, Optional[Reply], "Discovery"]

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


def _search(base_urls: Sequence[str], model_only: bool, config: ClientConfig | None, deadline: Deadline) -> Search:
    """Rounds of probes over ``base_urls``, URL after URL: a URL that answers nothing useful (an error status to
    every probe, or paths no dialect has) hands over to the next; the first that shows its routes (its model, for a
    model-only search) is the answer. A round without one is followed by another while a URL answered as a starting
    server does and ``config`` allows (``_next_wait``); else, or once the deadline passes during a probe, the error
    says why (``_gave_up``)."""
    cache, probe_of, found = _MODEL_ONLY if model_only else _FULL
    started, tries, replies = time.monotonic(), 0, {}
    while True:
        tries += 1
        previous, replies = replies, {}  # each URL's (path, reply) in the last round and in this one
        fallback: tuple[str, Discovery] | None = None  # model-only: the first URL sure to name no model
        for base_url in base_urls:
            if base_url in cache:
                return cache[base_url]
            seen = replies[base_url] = []
            discovery = yield from _ask(base_url, probe_of(), seen)
            if discovery is None and seen[-1][1].expired:  # what the last round saw, and this one so far
                report = {url: previous.get(url, []) + replies.get(url, []) for url in {**previous, **replies}}
                raise _gave_up(base_urls, report, tries, time.monotonic() - started,
                               f"deadline {deadline.seconds:g} s", model_only)
            if discovery is None:  # unreachable
                continue
            # Kept only when every probe got an answer about the server, not one of a server still starting (429,
            # 5xx) or a refusal of the credentials (401, 403: another key may read more).
            sure = not any(reply.retryable or reply.status in (401, 403) for _, reply in seen)
            if model_only:
                if discovery.model is not None:
                    return found(base_url, discovery)
                fallback = fallback or ((base_url, discovery) if sure else None)
            elif discovery.routes:
                return found(base_url, discovery) if sure else discovery
        if fallback is not None:
            return found(*fallback)
        wait, limit = _next_wait(config, deadline, tries, replies)
        if wait is None:
            raise _gave_up(base_urls, replies, tries, time.monotonic() - started, limit, model_only)
        yield wait


def _ask(base_url: str, probe: Probe, seen: list[tuple[str, Reply]]) -> Generator[Step, Reply, Discovery | None]:
    """``probe`` run against ``base_url``, each (path, reply) added to ``seen``: what it found, None when
    unreachable."""
    try:
        path = next(probe)
        while True:
            reply = yield base_url, path
            seen.append((path, reply))
            if reply.status is None:
                return None
            path = probe.send(reply)
    except StopIteration as ended:
        return ended.value


def _next_wait(config: ClientConfig | None, deadline: Deadline, tries: int,
               replies: dict[str, list[tuple[str, Reply]]]) -> tuple[float | None, str]:
    """Seconds to wait before the next round, as a scoring call waits before its next try; else None, with the
    limit reached (none where no URL answered as a starting server does)."""
    starting = [reply for seen in replies.values() for _, reply in seen if reply.retryable]
    if config is None or not starting:
        return None, ""
    if tries > config.max_retries:
        return None, f"max_retries={config.max_retries}"
    retry_after = min((reply.retry_after for reply in starting if reply.retry_after is not None), default=None)
    wait = config.backoff(tries, retry_after)
    if wait >= deadline.left():
        return None, f"deadline {deadline.seconds:g} s" + (f", Retry-After {retry_after:g} s" if retry_after else "")
    return wait, ""


def _gave_up(base_urls: Sequence[str], replies: dict[str, list[tuple[str, Reply]]], tries: int, waited: float,
             limit: str, model_only: bool) -> RemoteError:
    """Why no URL showed its routes (its model): none reached, one status to every probe, or no dialect found; with
    the tries made and the time waited where the server was waited for."""
    what, skip = ("its served model", "served_model=") if model_only else ("its dialect", "dialect=")
    tried = f", {tries} {'try' if tries == 1 else 'tries'} in {waited:.1f} s ({limit})" if limit else ""
    reached = {url: [(path, reply) for path, reply in seen if reply.status is not None]
               for url, seen in replies.items()}
    reached = {url: seen for url, seen in reached.items() if seen}
    if not reached:
        unreached = [reply for seen in replies.values() for _, reply in seen if reply.error]
        errors = [reply.error for reply in unreached if not reply.expired] or [reply.error for reply in unreached]
        why = f" ({errors[-1]})" if errors else ""
        return RemoteError(f"cannot reach {', '.join(base_urls)} to discover {what}{why}{tried}: is the server "
                           "up?", url=", ".join(base_urls))
    urls = ", ".join(reached)
    paths = ", ".join(dict.fromkeys(path for seen in reached.values() for path, _ in seen))
    answers = [reply for seen in reached.values() for _, reply in seen]
    statuses = sorted({reply.status for reply in answers if reply.status is not None})
    if len(statuses) == 1 and (status := statuses[0]) >= 400:
        why = ("check api_key" if status in (401, 403) else
               f"is the server still starting? Give it longer (deadline=, max_retries=) or pass {skip}"
               if answers[-1].retryable else f"pass {skip}")
        retry_after = min((reply.retry_after for reply in answers if reply.retry_after is not None), default=None)
        return RemoteError(f"every discovery probe ({paths}) got {status}{tried}: {why}", status, urls,
                           retry_after=retry_after)
    got = ", ".join(str(status) for status in statuses)
    return RemoteError(f"could not tell which dialect {urls} speaks (probed {paths}: got {got}){tried}; pass {skip}")


def discover(get: Callable[[str, str], Reply], base_urls: Sequence[str], *, model_only: bool = False,
             config: ClientConfig | None = None, deadline: Deadline | None = None,
             stop: Stop | None = None) -> Discovery:
    """The routes and model (cached) of the first server that shows them; ``get(base_url, path)`` does the I/O.

    ``model_only``: ask ``/v1/models`` only, for a client that was told its dialect (no routes are then found).
    ``config``: wait for a starting server per its ``max_retries`` and backoff, within ``deadline`` (None: one
    round of probes). ``stop``: once set (the backend closed), no further probe is made and a wait between rounds
    ends: ``Cancelled``, with the stop's ``reason``.
    """
    search, sent = _search(list(base_urls), model_only, config, deadline or Deadline(None)), None
    while True:
        if stop is not None:
            stop.check(_STOPPED)
        try:
            step = search.send(sent)
        except StopIteration as ended:
            return ended.value
        if isinstance(step, tuple):
            sent = get(*step)
        else:
            if stop is None:
                time.sleep(step)
            else:
                stop.wait(step)
            sent = None


async def adiscover(aget: Callable[[str, str], Awaitable[Reply]], base_urls: Sequence[str], *,
                    model_only: bool = False, config: ClientConfig | None = None, deadline: Deadline | None = None,
                    stop: Stop | None = None) -> Discovery:
    """Async twin of ``discover``. ``stop``: the search runs as its task (``Stop.run``), so setting it from any
    thread ends a probe in flight or a wait between rounds at once: ``Cancelled``, with the stop's ``reason``."""
    search = _search(list(base_urls), model_only, config, deadline or Deadline(None))
    if stop is None:
        return await _adrive(aget, search, None)
    return await stop.run(_adrive(aget, search, stop))


async def _adrive(aget: Callable[[str, str], Awaitable[Reply]], search: Search, stop: Stop | None) -> Discovery:
    sent = None
    while True:
        if stop is not None:  # a cancellation that ``wait_for`` swallowed (before Python 3.12) is seen here
            stop.check(_STOPPED)
        try:
            step = search.send(sent)
        except StopIteration as ended:
            return ended.value
        if isinstance(step, tuple):
            sent = await aget(*step)
        else:
            await asyncio.sleep(step)
            sent = None


_STOPPED = "discovery was stopped"
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
