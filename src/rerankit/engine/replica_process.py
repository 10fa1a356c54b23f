"""One data-parallel replica as its parent sees it: its process, inbox and reply pipe, the tasks it holds, its state
and its failures; and ``ReplicaStatus``, what ``DataParallelBackend.replica_status()`` tells of it."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from rerankit.schema import ScoreRequest

# Why a replica failed, as ``ReplicaStatus.failures`` counts it: its process ended while it was ready; it was killed
# after ``replica_timeout_s`` of silence; it did not get ready (its model failed to load, or its process ended first).
FAILURE_CAUSES = ("died", "timed_out", "failed_to_start")


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as ``DataParallelBackend.replica_status()`` found it.

    ``state``: "ready" (takes work), "starting" (loading its model, at start or after a restart) or "down" (for
    good: its model failed to load, or it failed more than ``MAX_RESTARTS`` times). ``pid``: its process's id while
    that process runs, else None. ``failures``: how often it failed, by cause (``FAILURE_CAUSES``); every failure but
    a failed load restarts it, up to ``MAX_RESTARTS`` times.
    """

    index: int
    device: str
    state: str
    pid: int | None
    restarts: int
    failures: dict[str, int]
    startup_seconds: float | None


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
    state: str = "starting"  # "starting" -> "ready"; "down" for good after a failed load or too many restarts
    restarts: int = 0
    started_at: float = 0.0  # time.monotonic() of the latest spawn
    startup_seconds: float | None = None  # spawn to ready: interpreter, imports, model load
    pipelined_calls: int = 1  # tasks it runs at once, as it reports when ready
    failure: Exception | None = None  # why it failed to load
    tasks: dict[int, Task] = field(default_factory=dict)
    last_progress: float = 0.0  # time.monotonic() of its latest reply, or of work sent to it while it held none
    timed_out: bool = False  # killed by ``replica_timeout_s``: its death is counted as "timed_out"
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_CAUSES, 0))

    @property
    def pid(self) -> int | None:
        """Its process's id while that process runs (a down replica's, or one dead and not yet restarted: None)."""
        if self.state == "down" or self.process is None or not self.process.is_alive():
            return None
        return self.process.pid

    @property
    def load(self) -> int:
        """Estimated tokens of the work sent and not answered."""
        return sum(task.tokens for task in self.tasks.values())

    def status(self, max_restarts: int) -> ReplicaStatus:
        return ReplicaStatus(self.index, self.device, self.state, self.pid, min(self.restarts, max_restarts),
                             dict(self.failures), self.startup_seconds)

    def close_channels(self) -> None:
        """Close its inbox and pipe: nothing may use them again (its semaphores go back now, not at exit)."""
        if self.replies is not None:
            self.replies.close()
        if self.inbox is not None:
            self.inbox.close()
            self.inbox.cancel_join_thread()  # messages no process will read must not block exit
        self.inbox = self.replies = None
