"""One data-parallel replica as its parent sees it: its process, inbox and reply pipe, the tasks it holds, its state
and its restart history; and ``ReplicaStatus``, what ``DataParallelBackend.replica_status()`` tells of it."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from rerankit.engine.restart_policy import RestartHistory
from rerankit.schema import ScoreRequest


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as ``DataParallelBackend.replica_status()`` found it.

    ``state``: "ready" (takes work), "starting" (loading its model, at start or after a failure, or waiting out the
    pause before a restart) or "down" (it failed too often, ``restart_policy.py``, or its model failed to load as the
    backend started). ``pid``: its process's id while that process runs, else None. ``failures``: how often it
    failed, by cause (``FAILURE_CAUSES``). ``restarts``: how often it was started again. ``retry_in_s``: while it is
    down, the seconds until it is started once more (``DOWN_RETRY_S`` after it went down); else None, as for every
    replica of a closed backend.
    """

    index: int
    device: str
    state: str
    pid: int | None
    restarts: int
    failures: dict[str, int]
    startup_seconds: float | None
    retry_in_s: float | None = None


@dataclass
class Task:
    """Work for one replica: a list of requests to score, or a warm-up and its shapes (None: the defaults),
    answered through ``future``."""

    id: int
    kind: str
    payload: list[ScoreRequest] | list[tuple[int, int]] | None
    tokens: int
    future: Future = field(default_factory=Future)
    retried: bool = False


@dataclass
class Replica:
    """One replica process, its inbox queue and its reply pipe, and the tasks it holds."""

    index: int
    device: str
    process: Any = None
    inbox: Any = None
    replies: Connection | None = None
    state: str = "starting"  # "starting" -> "ready"; "down" after a failed first load or too many failures
    history: RestartHistory = field(default_factory=RestartHistory)
    spawn_at: float | None = None  # time.monotonic() a restart's process is due to start (None: it has started)
    sender: Connection | None = None  # the reply pipe's writing end, until the process it is for starts
    started_at: float = 0.0  # time.monotonic() of the latest spawn
    startup_seconds: float | None = None  # spawn to ready: interpreter, imports, model load
    pipelined_calls: int = 1  # tasks it runs at once, as it reports when ready
    failure: Exception | None = None  # why its latest load failed
    tasks: dict[int, Task] = field(default_factory=dict)
    last_progress: float = 0.0  # time.monotonic() of its latest reply, or of work sent to it while it held none
    killed: str | None = None  # why the parent killed it: "timed_out" (``replica_timeout_s``) or "start_timed_out"

    @property
    def failures(self) -> dict[str, int]:
        """How often it failed, by cause."""
        return self.history.failures

    @property
    def restarts(self) -> int:
        """How often it was started again after a failure."""
        return self.history.restarts

    @property
    def pid(self) -> int | None:
        """Its process's id while that process runs (one down, or dead and not yet restarted: None)."""
        if self.state == "down" or self.process is None or not self.process.is_alive():
            return None
        return self.process.pid

    @property
    def load(self) -> int:
        """Estimated tokens of the work sent and not answered."""
        return sum(task.tokens for task in self.tasks.values())

    def status(self) -> ReplicaStatus:
        return ReplicaStatus(self.index, self.device, self.state, self.pid, self.restarts, dict(self.failures),
                             self.startup_seconds, self.history.retry_in_s(time.monotonic()))

    def renew(self, context: Any, delay_s: float) -> None:
        """A fresh inbox and pipe (a killed process may have left its own broken), its process due ``delay_s``
        from now; work sent meanwhile waits in the inbox."""
        self.replies, self.sender = context.Pipe(duplex=False)
        self.inbox = context.Queue()
        self.state = "starting"
        self.process = None
        self.spawn_at = time.monotonic() + delay_s

    def spawn(self, process: Any) -> None:
        """Start ``process`` (not started yet; it writes to ``sender``) as this replica's."""
        self.spawn_at = None
        self.started_at = time.monotonic()
        self.process = process
        process.start()
        self.sender.close()  # the child holds the only writing end: its death reads as end-of-file here
        self.sender = None

    def close_channels(self) -> None:
        """Close its inbox and pipe: nothing may use them again (its semaphores go back now, not at exit)."""
        for end in (self.replies, self.sender):
            if end is not None:
                end.close()
        if self.inbox is not None:
            self.inbox.close()
            self.inbox.cancel_join_thread()  # messages no process will read must not block exit
        self.inbox = self.replies = self.sender = None
