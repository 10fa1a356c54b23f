"""The ``fake`` fixture: data-parallel backends over fake replicas (``replica_fakes.py``) that load no model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import rerankit.engine.replicas as replicas_module
import rerankit.engine.restart_policy as policy
from rerankit.engine.replicas import DataParallelBackend
from replica_fakes import fake_replica


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Builds a backend of ``size`` replicas whose starts (counted across them) follow ``plan``, with ``options``
    for the backend (``replica_timeout_s``...); closes it after the test."""
    monkeypatch.setattr(replicas_module, "replica_main", fake_replica)
    monkeypatch.setattr(policy, "RESTART_BACKOFF_S", 0.05)
    built: list[DataParallelBackend] = []

    def build(*plan: str, size: int = 1, **options: Any) -> DataParallelBackend:
        backend = DataParallelBackend("fake", data_parallel_size=size, device="cpu", startup_timeout_s=60,
                                      plan=list(plan), journal=str(tmp_path / "starts"), **options)
        built.append(backend)
        return backend

    yield build
    for backend in built:
        backend.close()
