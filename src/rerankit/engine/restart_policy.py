"""When a data-parallel replica that failed is started again, and when it is kept down.

A replica is restarted after each failure unless it has failed more than ``MAX_RESTARTS`` times within the last
``RESTART_WINDOW_S`` seconds: then it stays down (until the backend is rebuilt, as a server's restart does). A
replica that fails once a week is restarted every time; one that cannot run (its model crashes the process on load,
a broken device) is given up after a few quick failures, as systemd's ``StartLimitBurst`` within
``StartLimitIntervalSec`` does. The first failure within the window restarts at once; each further one waits
``RESTART_BACKOFF_S`` seconds, doubled each time (at most ``RESTART_BACKOFF_MAX_S``), so a replica that dies as it
loads does not spin, and what made it fail (a device's memory not yet freed by the last process) has time to pass.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MAX_RESTARTS = 3  # restarts within RESTART_WINDOW_S; one more failure within it keeps the replica down
RESTART_WINDOW_S = 600.0
RESTART_BACKOFF_S = 5.0  # the wait before the second restart within the window; doubled for each one after
RESTART_BACKOFF_MAX_S = 60.0
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

    def fail(self, cause: str, now: float) -> float | None:
        """Count a failure at ``now``; the seconds to wait before restarting the replica, or None: it stays down."""
        self.failures[cause] += 1
        while self.recent and now - self.recent[0] > RESTART_WINDOW_S:
            self.recent.popleft()
        self.recent.append(now)
        if len(self.recent) > MAX_RESTARTS:
            return None
        self.restarts += 1
        return backoff_s(len(self.recent))

    def verdict(self, delay_s: float | None) -> str:
        """What ``fail`` decided, in words, for the log."""
        count = f"{len(self.recent)} failure(s) in the last {RESTART_WINDOW_S:g} s"
        if delay_s is None:
            return f"it stays down ({count}, more than the {MAX_RESTARTS} restart(s) allowed in that time)"
        return (f"restarting it{f' in {delay_s:g} s' if delay_s else ''} (restart {self.restarts}; {count}; "
                f"more than {MAX_RESTARTS} keep it down)")
