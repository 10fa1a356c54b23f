"""Faults of data-parallel replicas beyond a clean death: a hung replica, and a replica restarting after one."""

from __future__ import annotations

import os
import signal
import threading
import time

from rerankit.defaults import default_model_path
from rerankit.engine.replicas import DataParallelBackend
from rerankit.schema import ScoreRequest

REQUEST = ScoreRequest(query="capital of france", items=[f"document {n} on paris" for n in range(40)])


def test_a_hung_replica_is_killed_restarted_and_its_work_answered_by_the_other() -> None:
    with DataParallelBackend(default_model_path(), data_parallel_size=2, device="cpu", startup_timeout_s=120,
                             replica_timeout_s=3.0) as backend:
        expected = backend.score(REQUEST).scores
        victim = backend._replicas[0]
        os.kill(victim.process.pid, signal.SIGSTOP)  # a hung device: alive, silent
        try:
            outcome: dict = {}
            calls = [threading.Thread(target=lambda n=n: outcome.setdefault(n, backend.score(REQUEST).scores))
                     for n in range(4)]
            for call in calls:
                call.start()
            for call in calls:
                call.join(60)
            assert not any(call.is_alive() for call in calls), "a call on the hung replica never returned"
            assert all(scores == expected for scores in outcome.values()) and len(outcome) == 4
            assert victim.restarts == 1
            assert backend.replica_status()[0].failures == {"died": 0, "timed_out": 1, "failed_to_start": 0}
        finally:
            try:
                os.kill(victim.process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_a_restarting_replica_takes_no_work_while_another_is_ready() -> None:
    with DataParallelBackend(default_model_path(), data_parallel_size=2, device="cpu",
                             startup_timeout_s=120) as backend:
        backend.score_batch([REQUEST, REQUEST])
        victim = backend._replicas[0]
        os.kill(victim.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while victim.state != "starting" or victim.restarts != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        begun = time.monotonic()
        backend.score_batch([REQUEST, REQUEST])  # two requests: cut across spare replicas before the fix
        took = time.monotonic() - begun
        assert took < 1.0, f"the call waited {took:.1f} s for the restarting replica"
        assert victim.state == "starting", "the restart ended before the call: the test proves nothing"
        assert backend.problem() is None  # degraded, not down: the other replica serves
        os.kill(victim.process.pid, signal.SIGKILL)  # it dies again before it is ready
        while victim.restarts != 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert backend.replica_status()[0].failures == {"died": 1, "timed_out": 0, "failed_to_start": 1}
