"""``serve``: load one model and run the HTTP server on it with uvicorn (what ``rerankit serve`` calls)."""

from __future__ import annotations

import math
import os
import sys
from typing import Any

API_KEY_ENV = "RERANKIT_API_KEY"


def serve(model: str | None = None, *, host: str = "127.0.0.1", port: int = 8000, device: str | None = None,
          dtype: str | None = None, prefix_cache_bytes: int | None = None, api_key: str | None = None,
          log_level: str = "info", engine_options: dict[str, Any] | None = None, **settings: Any) -> None:
    """Serve ``model`` (path or hub id; None: the packaged MiniLM) until interrupted.

    ``device``, ``dtype``, ``prefix_cache_bytes`` and ``engine_options`` (e.g. the default ``mode``, ``template``,
    ``instruction``) go to the embedded engine (None: its defaults).
    ``api_key`` falls back to the ``RERANKIT_API_KEY`` environment variable. ``settings`` are
    ``ServerConfig`` fields (``max_batch_items``, ``batch_window_ms``, ``batching``, ``max_queue_requests``...);
    a setting passed as None keeps its default.
    """
    from rerankit.errors import RerankitError
    from rerankit.reranker import make_backend, missing_modules

    missing = missing_modules("fastapi", "uvicorn")
    if missing:
        raise RerankitError(f"the server needs {' and '.join(missing)}: pip install 'rerankit[server]'")
    from rerankit.server.app import create_app
    from rerankit.server.limits import ServerConfig
    from rerankit.server.shutdown import GRACE_AFTER_DRAIN_S, STARTUP_FAILURE, DrainingServer, uvicorn

    given = {name: value for name, value in settings.items() if value is not None}
    config = ServerConfig(**{"freeze_gc": True, **given, "api_key": api_key or os.environ.get(API_KEY_ENV) or None})
    options = {name: value for name, value in (("device", device), ("dtype", dtype),
                                                ("prefix_cache_bytes", prefix_cache_bytes)) if value is not None}
    backend = make_backend(model, **options, **(engine_options or {}))
    app = create_app(backend, config)
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=math.ceil(config.drain_seconds)
                                           + GRACE_AFTER_DRAIN_S),
                            app.state.batcher, config.drain_seconds)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it held once the shutdown is done
        pass
    finally:
        backend.close()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
