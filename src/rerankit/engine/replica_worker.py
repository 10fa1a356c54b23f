"""The process of one data-parallel replica: load an ``EmbeddedBackend`` on one device, score what the parent sends.

Messages. Parent -> replica, on the replica's inbox queue: ``(kind, task_id, payload)`` with kind "score" (payload:
a list of ``ScoreRequest``) or "warm_up" (payload: its shapes, or None), and ``None`` to stop. Replica -> parent,
on its own pipe: ``("ready", model_name, load_seconds, max_length, pipelined_calls)`` or ``("load_failed", error)``
once, then ``("done", task_id, result)`` or ``("failed", task_id, error)`` per task. A replica on a GPU runs two
tasks at once (``EmbeddedBackend.pipelined_calls``: one launches while the other's scores come back), so its GPU
does not wait for the host between calls; the parent keeps that many tasks in flight on it. Errors travel as they are
(``RerankitError`` pickles whole); one that cannot cross is replaced by a ``RerankitError`` naming it (``portable``).
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

PARENT_CHECK_S = 1.0  # how often an idle replica checks that its parent still runs (it exits with it)


def portable(error: BaseException) -> BaseException:
    """``error`` itself where it survives pickling (every ``RerankitError`` does); else a ``RerankitError`` naming
    its class and message, so that a reply never fails to send or to be read."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any error of a third-party exception's pickling
        from rerankit.errors import RerankitError

        return RerankitError(f"{type(error).__module__}.{type(error).__qualname__}: {error}")


def replica_main(model: str, options: dict[str, Any], threads: int | None, inbox: multiprocessing.Queue,
                 outbox: Connection) -> None:
    """Entry point of a replica process (spawned): load, say ready, then score tasks until told to stop."""
    no_named_semaphores()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)  # N CPU replicas share the cores instead of each taking them all
    device = str(options.get("device") or "")
    if device.startswith("cuda:"):  # kernels and CUDA graphs go to the current device: make it this replica's
        import torch

        torch.cuda.set_device(device)
    from rerankit.engine.backend import EmbeddedBackend

    begun = time.perf_counter()
    try:
        backend = EmbeddedBackend(model, **options)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it as its own
        outbox.send(("load_failed", portable(exc)))
        return
    workers = max(1, backend.pipelined_calls)
    outbox.send(("ready", backend.model_name, time.perf_counter() - begun, backend.max_length, workers))
    sending = threading.Lock()  # a Connection is not safe to send on from two threads at once

    def run(kind: str, task_id: int, payload: Any) -> None:
        try:
            if kind == "warm_up":
                result: Any = backend.warm_up(shapes=payload)
            else:
                result = [portable(outcome) if isinstance(outcome, BaseException) else outcome
                          for outcome in backend.score_batch(payload, return_exceptions=True)]
            reply = ("done", task_id, result)
        except Exception as exc:  # noqa: BLE001 - an error of the whole call (out of memory): the parent's
            reply = ("failed", task_id, portable(exc))
        with sending:
            outbox.send(reply)

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rerankit-replica") if workers > 1 else None
    try:
        while (message := _next_task(inbox)) is not None:
            if pool is None:
                run(*message)
            else:
                pool.submit(run, *message)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        backend.close()


def no_named_semaphores() -> None:
    """Keep tqdm from making a multiprocessing lock in this process.

    tqdm makes one (a named semaphore) the first time a bar is built, even a disabled one, as the engine builds one
    every call. A spawned replica registers it with the resource tracker it shares with its parent; a replica that is
    killed (``kill -9``, ``replica_timeout_s``) cannot take it back, and the parent's exit then warns of "leaked
    semaphore objects". The lock is of no use here: a spawned process would make its own, shared with no other.
    Threads keep tqdm's thread lock.
    """
    try:
        from tqdm.std import TqdmDefaultWriteLock
    except ImportError:  # pragma: no cover - tqdm comes with the engine's dependencies
        return
    if not hasattr(TqdmDefaultWriteLock, "mp_lock"):
        TqdmDefaultWriteLock.mp_lock = None  # "made already, and there is none": tqdm uses its thread lock alone


def _next_task(inbox: multiprocessing.Queue) -> tuple | None:
    """The next message, or None once told to stop or once the parent is gone (no orphan keeps a GPU)."""
    parent = multiprocessing.parent_process()
    while True:
        try:
            return inbox.get(timeout=PARENT_CHECK_S)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return None
        except (EOFError, OSError):
            return None

