"""The transport's decisions without I/O: endpoint rotation and cool-down, deadlines, backoff, the import promise."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from rerankit.remote.client import ClientConfig
from rerankit.remote.deadline import Deadline, Window
from rerankit.remote.endpoints import Endpoints


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_endpoints_rotate_and_a_dead_one_goes_last_until_its_cooldown_ends():
    clock = Clock()
    endpoints = Endpoints(["http://a/", "http://b", "http://c"], cooldown=30.0, clock=clock)
    assert [endpoints.order()[0] for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]
    endpoints.mark_dead("http://b")
    assert endpoints.order() == ["http://a", "http://c", "http://b"]
    assert endpoints.order() == ["http://c", "http://a", "http://b"]
    clock.now += 30.0
    assert endpoints.order() == ["http://a", "http://b", "http://c"]


def test_each_failure_in_a_row_doubles_the_cooldown_up_to_8x_and_an_answer_resets_it():
    clock = Clock()
    endpoints = Endpoints(["http://a", "http://b"], cooldown=10.0, clock=clock)
    cooldowns = []
    for _ in range(5):
        endpoints.mark_dead("http://a")
        # A failure of a try already in flight while it cools down is the same failure, not a new one.
        endpoints.mark_dead("http://a")
        started = clock.now
        while not endpoints.is_live("http://a"):
            clock.now += 1.0
        cooldowns.append(clock.now - started)
    assert cooldowns == [10.0, 20.0, 40.0, 80.0, 80.0]
    endpoints.mark_live("http://a")
    endpoints.mark_dead("http://a")
    assert endpoints.order() == ["http://b", "http://a"]
    clock.now += 10.0
    assert endpoints.is_live("http://a")


def test_an_endpoint_that_answers_is_live_again_at_once():
    endpoints = Endpoints(["http://a", "http://b"], cooldown=10.0, clock=Clock())
    endpoints.mark_dead("http://a")
    assert not endpoints.is_live("http://a")
    endpoints.mark_live("http://a")  # a try in flight when it was set aside has just succeeded
    assert endpoints.is_live("http://a")
    assert sorted(endpoints.order()[:1] + endpoints.order()[:1]) == ["http://a", "http://b"]  # in turn again


def test_a_deadline_of_none_never_expires_and_a_window_is_cut_by_the_deadline():
    assert Deadline(None).left() == math.inf and Deadline(None).wait_limit() is None
    window = Window.open(Deadline(None), try_seconds=5.0)
    assert window.seconds == 5.0 and not window.by_deadline
    window = Window.open(Deadline(1.0), try_seconds=5.0)
    assert window.by_deadline and 0.9 < window.seconds <= 1.0


@pytest.mark.parametrize("retry", [1, 2, 3, 6])
def test_backoff_doubles_with_jitter_and_is_capped(retry):
    config = ClientConfig(backoff_base=0.5, backoff_max=4.0)
    ceiling = min(4.0, 0.5 * 2 ** (retry - 1))
    delays = [config.backoff(retry, None) for _ in range(50)]
    assert all(ceiling / 2 <= delay <= ceiling for delay in delays)


def test_retry_after_is_honoured_up_to_the_cap():
    config = ClientConfig(backoff_max=4.0)
    assert config.backoff(1, 2.5) == 2.5
    assert config.backoff(1, 120.0) == 4.0


def test_remote_path_imports_without_torch():
    code = ("import sys, rerankit, rerankit.remote, rerankit.remote.discover; "
            "heavy = {'torch', 'transformers', 'triton'} & set(sys.modules); assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
