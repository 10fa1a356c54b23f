"""Loopback fault servers for the transport tests (see fault_server.py)."""

from __future__ import annotations

import socket

import pytest
from fault_server import FaultServer


@pytest.fixture
def servers():
    """Starts fault servers on demand; stops them all at the end."""
    started: list[FaultServer] = []

    def start(script=(), delays=(0.0, 0.0), default: str = "ok") -> FaultServer:
        server = FaultServer(script, delays, default)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def dead_url() -> str:
    """A loopback URL where nothing listens: connections are refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"
