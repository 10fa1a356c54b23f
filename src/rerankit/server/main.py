"""``serve``: load one model and run the HTTP server on it with uvicorn (what ``rerankit serve`` calls)."""

from __future__ import annotations

import os
from typing import Any

API_KEY_ENV = "RERANKIT_API_KEY"


def serve(model: str | None = None, *, host: str = "127.0.0.1", port: int = 8000, device: str | None = None,
          dtype: str | None = None, prefix_cache_bytes: int | None = None, api_key: str | None = None,
          log_level: str = "info", data_parallel_size: int | str | None = None, **settings: Any) -> None:
    """Serve ``model`` (path or hub id; None: the packaged MiniLM) until interrupted.

    ``device``, ``dtype`` and ``prefix_cache_bytes`` go to the embedded engine (None: its defaults);
    ``data_parallel_size`` N (or "auto") runs N engine replicas, one process per device (``engine/replicas.py``).
    ``api_key`` falls back to the ``RERANKIT_API_KEY`` environment variable. ``settings`` are
    ``ServerConfig`` fields (``max_batch_items``, ``batch_window_ms``, ``batching``, ``max_queue_requests``...);
    a setting passed as None keeps its default.
    """
    from rerankit.errors import RerankitError
    from rerankit.reranker import make_backend, missing_modules

    missing = missing_modules("fastapi", "uvicorn")
    if missing:
        raise RerankitError(f"the server needs {' and '.join(missing)}: pip install 'rerankit[server]'")
    import uvicorn

    from rerankit.server.app import create_app
    from rerankit.server.limits import ServerConfig

    given = {name: value for name, value in settings.items() if value is not None}
    config = ServerConfig(**{"freeze_gc": True, **given, "api_key": api_key or os.environ.get(API_KEY_ENV) or None})
    engine_options = {name: value for name, value in (("device", device), ("dtype", dtype),
                                                       ("prefix_cache_bytes", prefix_cache_bytes),
                                                       ("data_parallel_size", data_parallel_size)) if value is not None}
    backend = make_backend(model, **engine_options)
    try:
        uvicorn.run(create_app(backend, config), host=host, port=port, log_level=log_level,
                    timeout_graceful_shutdown=5)
    finally:
        backend.close()
