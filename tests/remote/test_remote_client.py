"""The transport's decisions without I/O: endpoint rotation and cool-down, backoff, and the import promise."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rerankit.remote.client import ClientConfig, Endpoints


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
