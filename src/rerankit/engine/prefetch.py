"""Run a generator on a worker thread, a few items ahead of its consumer.

The embedded backend plans on the host (tokenize, pack, pin) while the GPU runs the micro-batches already launched:
the tokenizer and numpy release the GIL, so planning micro-batch k+1 overlaps the launches of micro-batch k, and
the GPU is not left idle while a call's first request is tokenized.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

_Item = TypeVar("_Item")
_POLL_S = 0.05  # how often a blocked worker checks whether its consumer has gone


def prefetch(items: Iterator[_Item], depth: int, name: str = "rerankit-prefetch") -> Iterator[_Item]:
    """Yield what ``items`` yields, in order, computed on a worker thread at most ``depth`` items ahead.

    An exception raised by ``items`` is raised here, at the point in the sequence where it happened. When the
    consumer stops early (an error of its own, or it drops the iterator), the worker stops at its next item and
    is joined before this generator finishes closing.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def hand_over(kind: str, value) -> bool:
        while not stop.is_set():
            try:
                ready.put((kind, value), timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in items:
                if not hand_over("item", item):
                    return
        except BaseException as error:  # handed to the consumer, which raises it
            hand_over("error", error)
        else:
            hand_over("done", None)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    worker = threading.Thread(target=work, name=name, daemon=True)
    worker.start()
    try:
        while True:
            kind, value = ready.get()
            if kind == "item":
                yield value
            elif kind == "error":
                raise value
            else:
                return
    finally:
        stop.set()
        worker.join()
