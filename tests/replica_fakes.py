"""A stand-in for a data-parallel replica's process (``replica_worker.replica_main``) that loads no model.

Each start of the replica takes the next step of ``options["plan"]`` (the last one repeats) and writes a line to
``options["journal"]``: "ready" (says ready, then answers every task), "hang" (a load that never ends), "crash" (the
process ends as it loads), "fail" (the load raises). It imports neither torch nor the engine, so a restart takes a
fraction of a second: tests of the restart policy need no model load.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from pathlib import Path
from typing import Any

from rerankit.errors import ModelLoadError
from rerankit.schema import ScoreResponse, ScoreResult, Usage


def fake_replica(model: str, options: dict[str, Any], threads: int | None, inbox: Any, outbox: Any) -> None:
    journal = Path(options["journal"])
    starts = len(journal.read_text().splitlines()) if journal.exists() else 0
    plan = options["plan"]
    step = plan[min(starts, len(plan) - 1)]
    with journal.open("a") as lines:
        lines.write(f"{time.monotonic()} {step}\n")
    if step == "hang":
        time.sleep(3600)
    elif step == "crash":
        os._exit(3)
    elif step == "fail":
        outbox.send(("load_failed", ModelLoadError("out of memory (fake)")))
        return
    outbox.send(("ready", "fake-model", 0.0, 512, 1))
    parent = multiprocessing.parent_process()
    while True:
        try:
            message = inbox.get(timeout=0.5)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return
            continue
        if message is None:
            return
        kind, task_id, payload = message
        result: Any = 0.0 if kind == "warm_up" else [
            ScoreResponse(results=[ScoreResult(index=index, score=float(index)) for index in range(len(request.items))],
                          model="fake-model", usage=Usage(prompt_tokens=len(request.items)))
            for request in payload]
        outbox.send(("done", task_id, result))
