"""The restart policy of data-parallel replicas: a bounded restart, failures counted within a window, a pause
between quick restarts. The replicas are fakes (``replica_fakes.py``) that load no model, so each test takes seconds."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import rerankit.engine.replicas as replicas_module
import rerankit.engine.restart_policy as policy
from rerankit.engine.replicas import DataParallelBackend
from rerankit.engine.restart_policy import RestartHistory, backoff_s
from rerankit.schema import ScoreRequest
from replica_fakes import fake_replica

REQUEST = ScoreRequest(query="q", items=["a", "b", "c"])
NO_FAILURES = {"died": 0, "timed_out": 0, "failed_to_start": 0}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Builds a one-replica backend whose starts follow ``plan``; closes it after the test."""
    monkeypatch.setattr(replicas_module, "replica_main", fake_replica)
    monkeypatch.setattr(policy, "RESTART_BACKOFF_S", 0.05)
    built: list[DataParallelBackend] = []

    def build(*plan: str) -> DataParallelBackend:
        backend = DataParallelBackend("fake", data_parallel_size=1, device="cpu", startup_timeout_s=60,
                                      plan=list(plan), journal=str(tmp_path / "starts"))
        built.append(backend)
        return backend

    yield build
    for backend in built:
        backend.close()


def wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def status(backend: DataParallelBackend):
    return backend.replica_status()[0]


def kill(backend: DataParallelBackend) -> None:
    """Kill the replica's process, and wait until its death is handled: it is restarting, or down."""
    failures = sum(status(backend).failures.values())
    os.kill(backend._replicas[0].process.pid, signal.SIGKILL)
    wait_until(lambda: sum(status(backend).failures.values()) > failures, "the replica's death was not handled")


def test_failures_count_within_a_window_and_quick_ones_wait_longer_each_time(monkeypatch) -> None:
    monkeypatch.setattr(policy, "RESTART_BACKOFF_S", 5.0)
    history = RestartHistory()
    assert [history.fail("died", at) for at in (0.0, 10.0, 20.0)] == [0.0, 5.0, 10.0]
    assert history.fail("died", 30.0) is None  # a 4th failure within 600 s: down
    history = RestartHistory()
    weekly = [history.fail("died", week * 7 * 86400.0) for week in range(20)]
    assert weekly == [0.0] * 20 and history.restarts == 20 and history.failures["died"] == 20
    assert [backoff_s(n) for n in (1, 2, 3, 4, 5, 9)] == [0.0, 5.0, 10.0, 20.0, 40.0, 60.0]


def test_a_restart_that_hangs_loading_is_killed_after_the_startup_timeout_and_restarted(fake) -> None:
    backend = fake("ready", "hang", "ready")
    backend._startup_timeout_s = 0.5  # the constructor is done: the bound now applies to restarts
    kill(backend)
    wait_until(lambda: status(backend).pid is not None, "no restart under way")
    assert status(backend).state == "starting"
    deadline = time.monotonic() + 8
    # held by the hung restart, then retried on the next one (without the bound: for ever, so the call gives up)
    response = backend.score_batch([REQUEST], should_stop=lambda: time.monotonic() > deadline)[0]
    assert response.scores == [0.0, 1.0, 2.0]
    now = status(backend)
    assert now.state == "ready" and now.restarts == 2
    assert now.failures == {**NO_FAILURES, "died": 1, "failed_to_start": 1}


def test_failures_far_apart_keep_a_replica_restarting_and_quick_ones_keep_it_down(fake, monkeypatch) -> None:
    monkeypatch.setattr(policy, "MAX_RESTARTS", 1)
    monkeypatch.setattr(policy, "RESTART_WINDOW_S", 1.0)
    backend = fake("ready")
    replica = backend._replicas[0]
    kill(backend)
    wait_until(lambda: status(backend).state == "ready", "the first restart did not get ready")
    time.sleep(max(0.0, replica.history.recent[-1] + 1.1 - time.monotonic()))  # the first failure leaves the window
    kill(backend)
    assert status(backend).state == "starting", "a failure after the window kept the replica down"
    wait_until(lambda: status(backend).state == "ready", "the second restart did not get ready")
    assert backend.score(REQUEST).scores == [0.0, 1.0, 2.0]
    kill(backend)  # a second failure within the window
    assert status(backend).state == "down" and status(backend).restarts == 2
    assert backend.problem() == "no replica is running: every one failed to start or died too often"


def test_quick_restarts_wait_longer_each_time_and_then_the_replica_stays_down(fake, monkeypatch) -> None:
    monkeypatch.setattr(policy, "RESTART_BACKOFF_S", 0.2)
    events: list[tuple[str, float]] = []
    spawn, died = DataParallelBackend._spawn, DataParallelBackend._died
    monkeypatch.setattr(DataParallelBackend, "_spawn",
                        lambda self, *args: events.append(("spawn", time.monotonic())) or spawn(self, *args))
    monkeypatch.setattr(DataParallelBackend, "_died",
                        lambda self, *args: events.append(("died", time.monotonic())) or died(self, *args))
    backend = fake("ready", "crash")  # every restart's process ends as it loads
    replica = backend._replicas[0]
    os.kill(replica.process.pid, signal.SIGKILL)
    wait_until(lambda: status(backend).state == "down", "the replica did not stay down")
    assert [kind for kind, _ in events] == ["spawn"] + ["died", "spawn"] * 3 + ["died"]
    pauses = [events[n + 1][1] - events[n][1] for n in range(1, 7, 2)]  # from each death to the next spawn
    assert pauses[0] < 0.2  # the first failure in the window: at once
    assert 0.2 <= pauses[1] < 0.2 + 0.5 and 0.4 <= pauses[2] < 0.4 + 0.5
    assert status(backend).failures == {**NO_FAILURES, "died": 1, "failed_to_start": 3}
    assert status(backend).restarts == 3


def test_a_restarts_failed_load_is_a_failure_like_any_other(fake) -> None:
    backend = fake("ready", "fail", "ready")  # e.g. the device's memory not yet freed by the dead process
    kill(backend)
    wait_until(lambda: status(backend).state == "ready" and status(backend).restarts == 2, "it did not come back")
    assert status(backend).failures == {**NO_FAILURES, "died": 1, "failed_to_start": 1}
    assert backend.score(REQUEST).scores == [0.0, 1.0, 2.0]
