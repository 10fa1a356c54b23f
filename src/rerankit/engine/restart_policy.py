"""When a data-parallel replica that failed is started again, and when it is kept down.

A replica is restarted after each failure unless it has failed more than ``MAX_RESTARTS`` times within the last
``RESTART_WINDOW_S`` seconds: then it is down. A replica that fails once a week is restarted every time; one that
cannot run (its model crashes the process on load, a broken device) is given up after a few quick failures, as
systemd's ``StartLimitBurst`` within ``StartLimitIntervalSec`` does. The first failure within the window restarts at
once; each further one waits ``RESTART_BACKOFF_S`` seconds, doubled each time (at most ``RESTART_BACKOFF_MAX_S``), so
a replica that dies as it loads does not spin, and what made it fail (a device's memory not yet freed by the last
process) has time to pass.

A replica that is down is started once more ``DOWN_RETRY_S`` seconds later, as Kubernetes keeps retrying a pod in
CrashLoopBackOff: what kept it down (a device error that clears, a file system that recovers, memory another process
held) may have passed. If that start gets ready, the replica is back, its failures within the window counted afresh;
if it does not, it is down again for another ``DOWN_RETRY_S``, and so on while it fails.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MAX_RESTARTS = 3  # restarts within RESTART_WINDOW_S; one more failure within it keeps the replica down
RESTART_WINDOW_S = 600.0
RESTART_BACKOFF_S = 5.0  # the wait before the second restart within the window; doubled for each one after
RESTART_BACKOFF_MAX_S = 60.0
DOWN_RETRY_S = 600.0  # a replica that is down is started once more this long after, again after each such wait
# Why a replica failed, as ``ReplicaStatus.failures`` counts it: its process ended while it was ready; it was killed
# after ``replica_timeout_s`` of silence; it did not get ready (its model failed to load, its process ended first,
# or it was still loading ``startup_timeout_s`` after its start and was killed).
FAILURE_CAUSES = ("died", "timed_out", "failed_to_start")


def backoff_s(failures_in_window: int) -> float:
    """The wait before restarting a replica that has failed this often within the window (this failure included)."""
    if failures_in_window <= 1:
        return 0.0
    return min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** (failures_in_window - 2))


@dataclass
class RestartHistory:
    """One replica's failures by cause, how often it was restarted, and when its failures within the window were."""

    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_CAUSES, 0))
    restarts: int = 0
    recent: deque[float] = field(default_factory=deque)  # time.monotonic() of each failure within the window
    retry_at: float | None = None  # time.monotonic() a replica that is down is due to be started once more
    retrying: bool = False  # its latest start is a try after ``DOWN_RETRY_S`` down: failing to get ready keeps it down

    def fail(self, cause: str, now: float) -> float | None:
        """Count a failure at ``now``; the seconds to wait before restarting the replica, or None: it is down, and
        ``retry_at`` says when it is started once more."""
        self.failures[cause] += 1
        while self.recent and now - self.recent[0] > RESTART_WINDOW_S:
            self.recent.popleft()
        self.recent.append(now)
        retried, self.retrying = self.retrying, False  # "died" or "timed_out": that try had got ready
        if len(self.recent) > MAX_RESTARTS or (retried and cause == "failed_to_start"):
            self.retry_at = now + DOWN_RETRY_S
            return None
        self.restarts += 1
        return backoff_s(len(self.recent))

    def retry_due(self, now: float) -> bool:
        """Whether a replica that is down is due to be started once more."""
        return self.retry_at is not None and now >= self.retry_at

    def retry(self) -> None:
        """Count the start of a replica that was down as a restart; its failures within the window count afresh."""
        self.retry_at, self.retrying = None, True
        self.recent.clear()
        self.restarts += 1

    def retry_in_s(self, now: float) -> float | None:
        """Seconds until a replica that is down is started once more; None where none is due."""
        return None if self.retry_at is None else max(0.0, self.retry_at - now)

    def verdict(self, delay_s: float | None) -> str:
        """What ``fail`` decided, in words, for the log."""
        count = f"{len(self.recent)} failure(s) in the last {RESTART_WINDOW_S:g} s"
        if delay_s is None and len(self.recent) > MAX_RESTARTS:
            return (f"it is down, tried once more in {DOWN_RETRY_S:g} s ({count}, more than the {MAX_RESTARTS} "
                    "restart(s) allowed in that time)")
        if delay_s is None:  # a try after being down that did not get ready
            return f"it is down again, tried once more in {DOWN_RETRY_S:g} s (its try after being down did not load)"
        return (f"restarting it{f' in {delay_s:g} s' if delay_s else ''} (restart {self.restarts}; {count}; "
                f"more than {MAX_RESTARTS} keep it down)")
