"""Real uvicorn servers on 127.0.0.1 in threads of the test session, on ports the OS picks.

``lm_url`` serves the tiny Qwen3 CausalLM (generative routes), ``ce_url`` the tiny BERT cross-encoder; both are
started once per session, over the same ``EmbeddedBackend`` objects the tests compare with (``lm``, ``ce``).
``errors`` records what the server logs at warning and above during a test.
"""

from __future__ import annotations

import logging

import pytest
from live_server import live_server

from rerankit.server.app import create_app
from rerankit.server.limits import ServerConfig


# The long window makes a held-back lone request obvious; the small limits are what the limit tests hit.
LM_CONFIG = ServerConfig(served_model_name="tiny-lm", batch_window_ms=200)
CE_CONFIG = ServerConfig(served_model_name="tiny-ce", max_tokens_per_item=64, max_items_per_request=16)


@pytest.fixture(scope="session")
def lm_url(lm):
    with live_server(create_app(lm, LM_CONFIG)) as url:
        yield url


@pytest.fixture(scope="session")
def ce_url(ce):
    with live_server(create_app(ce, CE_CONFIG)) as url:
        yield url


@pytest.fixture
def errors():
    """Records of warning and above from the server's loggers (uvicorn's do not reach the root logger)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "uvicorn", "rerankit", "asyncio", "")]
    for logger in loggers:
        logger.addHandler(handler)
    yield records
    for logger in loggers:
        logger.removeHandler(handler)
