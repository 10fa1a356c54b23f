"""What keeps an embedded backend usable from event loops and forked processes: an awaited call that stops when
its task is cancelled, and a fork hook that gives a child its own locks, threads and (on the CPU) torch threads."""

from __future__ import annotations

import asyncio
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from rerankit.schema import ScoreRequest, ScoreResponse

LIVE_BACKENDS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # EmbeddedBackends, made fit for a forked child
FORKED_THREADS_WARNING = (
    "rerankit: this process was forked from one that had loaded a model and ran torch on {threads} CPU threads; "
    "torch's OpenMP pool does not survive fork (a call here would hang), so this process scores on 1 thread "
    "(torch.set_num_threads(1)). To use several threads per worker, build the Reranker in each worker instead: "
    "gunicorn without --preload (or in a post_fork hook), multiprocessing with the 'spawn' or 'forkserver' start "
    "method.")


async def score_cancellably(score_batch: Callable[..., list], request: ScoreRequest) -> ScoreResponse:
    """``score_batch([request])[0]`` on a worker thread, so the event loop keeps running; cancelling the awaiting
    task stops the call before its next micro-batch (``should_stop``), so it no longer holds the model for a
    caller that has gone."""
    stop = threading.Event()
    try:
        return await asyncio.to_thread(lambda: score_batch([request], should_stop=stop.is_set)[0])
    except asyncio.CancelledError:
        stop.set()
        raise


def _after_fork_in_child() -> None:
    """``os.register_at_fork`` hook: a child forked while EmbeddedBackends lived (gunicorn --preload, a
    multiprocessing 'fork' pool) gets their locks and threads afresh (``EmbeddedBackend._after_fork``), and, where
    torch ran on several CPU threads, one thread: GNU OpenMP's pool is not re-made after fork, and the child's first
    parallel torch op waits on it forever. A CUDA backend is left as it is: torch itself refuses CUDA in a forked
    child."""
    backends = [backend for backend in list(LIVE_BACKENDS) if backend._loaded is not None]
    for backend in backends:
        backend._after_fork()
    on_cpu = any(backend._loaded.device.type == "cpu" for backend in backends)
    threads = torch.get_num_threads()
    if on_cpu and threads > 1:
        torch.set_num_threads(1)
        warnings.warn(FORKED_THREADS_WARNING.format(threads=threads), RuntimeWarning, stacklevel=1)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)
