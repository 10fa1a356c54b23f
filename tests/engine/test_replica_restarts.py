"""The restart policy of data-parallel replicas: a bounded restart, failures counted within a window, a pause
between quick restarts, a replica that is down started once more after a wait. The replicas are fakes
(``replica_fakes.py``, through the ``fake`` fixture of conftest.py) that load no model, so each test takes
seconds."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import rerankit.engine.restart_policy as policy
from rerankit.engine.replicas import DataParallelBackend
from rerankit.engine.restart_policy import RestartHistory, backoff_s
from rerankit.errors import ReplicaDied
from rerankit.schema import ScoreRequest
from rerankit.server.metrics import Metrics

REQUEST = ScoreRequest(query="q", items=["a", "b", "c"])
NO_FAILURES = {"died": 0, "timed_out": 0, "failed_to_start": 0}


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


def starts(tmp_path: Path) -> list[tuple[float, str]]:
    """Each start of a fake replica so far: when (time.monotonic()) and its plan's step."""
    return [(float(at), step) for at, step in (line.split() for line in (tmp_path / "starts").read_text().splitlines())]


def metrics(backend: DataParallelBackend) -> list[str]:
    """The replicas' lines of a server's /metrics page."""
    return Metrics.replica_lines(backend.replica_status())


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


def test_a_replica_that_is_down_is_tried_again_after_each_wait_and_a_failed_try_keeps_it_down(monkeypatch) -> None:
    monkeypatch.setattr(policy, "MAX_RESTARTS", 1)
    monkeypatch.setattr(policy, "DOWN_RETRY_S", 100.0)
    history = RestartHistory()
    assert [history.fail("died", at) for at in (0.0, 1.0)] == [0.0, None]  # more than 1 restart in the window
    assert history.retry_at == 101.0 and history.retry_in_s(1.0) == 100.0
    assert not history.retry_due(100.9) and history.retry_due(101.0)
    history.retry()
    assert history.restarts == 2 and history.retry_in_s(101.0) is None and not history.retry_due(1e9)
    assert history.fail("failed_to_start", 102.0) is None  # that try did not load: down again, a fresh wait
    assert history.retry_at == 202.0 and "down again, tried once more in 100 s" in history.verdict(None)
    history.retry()
    assert history.fail("died", 300.0) == 0.0  # that try had got ready: restarted at once, its window afresh
    assert history.restarts == 4 and history.failures == {**NO_FAILURES, "died": 3, "failed_to_start": 1}


def test_a_replica_that_is_down_comes_back_after_the_wait_and_takes_work(fake, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(policy, "MAX_RESTARTS", 0)  # the first failure keeps it down
    monkeypatch.setattr(policy, "DOWN_RETRY_S", 0.4)
    backend = fake("ready", "fail", "ready")  # its first try after the wait fails to load, the second gets ready
    kill(backend)
    down = status(backend)
    assert down.state == "down" and down.pid is None and 0.0 < down.retry_in_s <= 0.4
    assert 'rerankit_replicas{state="down"} 1' in metrics(backend)
    with pytest.raises(ReplicaDied, match="no replica is running"):
        backend.score(REQUEST)  # while it is down, a call fails at once rather than wait for the try
    wait_until(lambda: status(backend).failures["failed_to_start"] == 1, "it was not tried again", 5)
    again = status(backend)
    assert again.state == "down" and again.restarts == 1 and 0.2 < again.retry_in_s <= 0.4  # a fresh wait
    wait_until(lambda: status(backend).state == "ready", "the second try did not get ready", 5)
    back = status(backend)
    assert back.restarts == 2 and back.retry_in_s is None and back.pid == backend._replicas[0].process.pid
    assert back.failures == {**NO_FAILURES, "died": 1, "failed_to_start": 1}
    assert backend.score(REQUEST).scores == [0.0, 1.0, 2.0] and backend.problem() is None
    lines = metrics(backend)
    assert 'rerankit_replicas{state="ready"} 1' in lines and 'rerankit_replicas{state="down"} 0' in lines
    assert 'rerankit_replica_failures_total{replica="0",cause="failed_to_start"} 1' in lines
    assert 'rerankit_replica_failures_total{replica="0",cause="died"} 1' in lines
    assert [step for _, step in starts(tmp_path)] == ["ready", "fail", "ready"]
    kill(backend)  # it fails again later: down again (MAX_RESTARTS is 0), and tried again after the wait
    assert status(backend).state == "down" and status(backend).failures["died"] == 2


def test_a_replica_that_keeps_failing_is_tried_once_per_wait_and_the_others_serve_meanwhile(fake, monkeypatch,
                                                                                             tmp_path) -> None:
    monkeypatch.setattr(policy, "MAX_RESTARTS", 0)
    monkeypatch.setattr(policy, "DOWN_RETRY_S", 0.3)
    backend = fake("ready", "ready", "crash", size=2)  # both start; every later start crashes as it loads
    kill(backend)
    went_down = time.monotonic()
    slowest = 0.0
    while len([step for _, step in starts(tmp_path) if step == "crash"]) < 3:  # replica 1 serves calls meanwhile
        assert time.monotonic() - went_down < 5, "the replica that is down was not tried again 3 times"
        call = time.monotonic()
        assert backend.score(REQUEST).scores == [0.0, 1.0, 2.0]
        slowest = max(slowest, time.monotonic() - call)
        assert backend.replica_status()[1].state == "ready" and backend.problem() is None
        time.sleep(0.02)
    assert slowest < 0.5, f"a call took {slowest:.2f} s while replica 0 was tried again"
    tries = [at for at, step in starts(tmp_path) if step == "crash"]
    took = time.monotonic() - went_down
    assert len(tries) <= took / 0.3, f"{len(tries)} tries in {took:.2f} s with 0.3 s between them: it spun"
    assert tries[0] - went_down >= 0.3 and all(later - earlier >= 0.3 for earlier, later in zip(tries, tries[1:]))
    # down again after its latest try, with a fresh wait (read well before the next try)
    wait_until(lambda: status(backend).state == "down" and status(backend).retry_in_s > 0.15, "not down again", 5)
    down = status(backend)
    tried = len(starts(tmp_path)) - 2
    assert down.restarts == tried and down.failures == {**NO_FAILURES, "died": 1, "failed_to_start": tried}
    assert backend.replica_status()[1].retry_in_s is None
    lines = metrics(backend)
    assert 'rerankit_replicas{state="down"} 1' in lines and 'rerankit_replicas{state="ready"} 1' in lines
    assert f'rerankit_replica_failures_total{{replica="0",cause="failed_to_start"}} {tried}' in lines


def test_close_while_a_replica_is_down_returns_at_once_and_starts_nothing(fake, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(policy, "MAX_RESTARTS", 0)
    monkeypatch.setattr(policy, "DOWN_RETRY_S", 1.2)
    backend = fake("ready")
    kill(backend)
    went_down = time.monotonic()
    assert status(backend).state == "down" and status(backend).retry_in_s > 1.0
    backend.close()
    assert time.monotonic() - went_down < 1.0, "close() waited for the replica's next try"
    assert status(backend).retry_in_s is None  # nothing is due: the backend is closed
    time.sleep(max(0.0, went_down + 1.6 - time.monotonic()))  # past the time of its next try
    assert len(starts(tmp_path)) == 1 and status(backend).state == "down" and status(backend).pid is None
    assert status(backend).restarts == 0
