"""``serve``: load one model and run the HTTP server on it with uvicorn (what ``rerankit serve`` calls)."""

from __future__ import annotations

import errno
import gc
import logging
import logging.config
import math
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

API_KEY_ENV = "RERANKIT_API_KEY"

log = logging.getLogger("rerankit.server")


def serve(model: str | None = None, *, host: str = "127.0.0.1", port: int = 8000, device: str | None = None,
          dtype: str | None = None, prefix_cache_bytes: int | None = None,
          api_key: str | Sequence[str] | None = None,
          log_level: str = "info", log_format: str = "text", data_parallel_size: int | str | None = None,
          engine_options: dict[str, Any] | None = None, ssl_certfile: str | None = None,
          ssl_keyfile: str | None = None, ssl_keyfile_password: str | None = None, ssl_ca_certs: str | None = None,
          otlp_traces_endpoint: str | None = None, otlp_service_name: str | None = None,
          **settings: Any) -> None:
    """Serve ``model`` (path or hub id; None: the packaged MiniLM) until interrupted.

    ``device``, ``dtype``, ``prefix_cache_bytes`` and ``engine_options`` (e.g. the default ``mode``, ``template``,
    ``instruction``) go to the embedded engine (None: its defaults); ``data_parallel_size`` N (or "auto") runs N
    engine replicas, one process per device (``engine/replicas.py``).
    ``api_key`` (one key, or several: any of them is taken, for rotating a key without downtime) falls back to
    the ``RERANKIT_API_KEY`` environment variable. ``settings`` are
    ``ServerConfig`` fields (``max_batch_items``, ``batch_window_ms``, ``batching``, ``max_queue_requests``,
    ``max_connections``, ``header_timeout_s``...); a setting passed as None keeps its default.
    ``log_format``: "text" (uvicorn's lines) or "json" (one object a line, with the request id: ``server/logs.py``).
    ``ssl_certfile`` (with ``ssl_keyfile`` unless the key is in it) serves HTTPS; ``ssl_ca_certs`` then requires
    client certificates signed by those CAs (``server/tls.py``).
    ``otlp_traces_endpoint``: send OpenTelemetry traces to this OTLP collector, as service ``otlp_service_name``
    (``server/tracing.py``); what is left is sent on shutdown.
    The port is taken and the TLS files read before the model loads: a port in use, a file that does not load or
    a tracing set-up that cannot work is a ``RerankitError`` at once.
    """
    from rerankit.errors import RerankitError
    from rerankit.reranker import is_url, make_backend, missing_modules

    missing = missing_modules("fastapi", "uvicorn")
    if missing:
        raise RerankitError(f"the server needs {' and '.join(missing)}: pip install 'rerankit[server]'")

    from rerankit.server.app import create_app, public_model_name
    from rerankit.server.connections import uvicorn_config
    from rerankit.server.limits import ServerConfig
    from rerankit.server.logs import log_config
    from rerankit.server.shutdown import GRACE_AFTER_DRAIN_S, STARTUP_FAILURE, DrainingServer, raise_exit_signals
    from rerankit.server.tls import tls_of
    from rerankit.server.tracing import setup_tracing

    tls = tls_of(ssl_certfile, ssl_keyfile, ssl_keyfile_password, ssl_ca_certs)
    if tls is not None:
        tls.check()
    if otlp_service_name and not otlp_traces_endpoint:
        raise RerankitError("--otlp-service-name names the spans that --otlp-traces-endpoint sends; give both")
    traces = setup_tracing(otlp_traces_endpoint, otlp_service_name) if otlp_traces_endpoint else None

    given = {name: value for name, value in settings.items() if value is not None}
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    if any(not key.strip() for key in keys):  # an unset secret must not open the server
        raise RerankitError("api_key: a key is empty; give the key, or leave api_key out to serve without one")
    if not keys and API_KEY_ENV in os.environ:  # set but blank: a secret that did not arrive, not "no key"
        if not os.environ[API_KEY_ENV].strip():
            raise RerankitError(f"${API_KEY_ENV} is set but empty; give the key, or unset it to serve without one")
        keys = (os.environ[API_KEY_ENV],)
    config = ServerConfig(**{"freeze_gc": True, **given, "api_key": keys or None})
    engine_options = {**{name: value for name, value in (("device", device), ("dtype", dtype),
                                                          ("prefix_cache_bytes", prefix_cache_bytes),
                                                          ("data_parallel_size", data_parallel_size))
                         if value is not None}, **(engine_options or {})}
    if not is_url(model):
        engine_options["show_progress"] = False  # a server's log is no terminal: no progress bars
    logs = log_config(log_level, log_format)
    logging.config.dictConfig(logs)
    listener = listen(host, port)
    raise_open_files_limit(config.max_connections + 256)  # + the model's files, threads and refused connections
    try:
        log.info("loading %s...", config.served_model_name or public_model_name(model))
        backend = make_backend(model, **engine_options)
        try:
            app = create_app(backend, config)
            # uvicorn's own graceful-shutdown timeout outlasts the drain: it never cancels a request itself.
            server = DrainingServer(uvicorn_config(app, config, host=host, port=port, log_config=logs,
                                                   log_level=log_level, timeout_graceful_shutdown=math.ceil(
                                                       config.drain_seconds) + GRACE_AFTER_DRAIN_S,
                                                   **(tls.uvicorn_options() if tls is not None else {})),
                                    app.state.batcher, config.drain_seconds, config.header_timeout_s)
            server.run(sockets=[listener])
        except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down and raises it again, as uvicorn.run() ignores it
            pass
        finally:
            # What freeze_gc froze is never collected, so the interpreter's exit would find triton's objects alive
            # and nanobind print ~40 lines of "leaked" warnings.
            gc.unfreeze()
            backend.close()
    finally:
        listener.close()
        if traces is not None:
            traces.shutdown()  # the spans still batched go to the collector
    if not server.started:
        sys.exit(STARTUP_FAILURE)
    # SIGTERM: the process ends by it, as uvicorn's would, but only now that the backend is closed and the spans sent
    raise_exit_signals(getattr(server, "exit_signals", ()))


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening: clients are refused until the server is ready)."""
    from rerankit.errors import RerankitError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise RerankitError(f"host {host!r}: {exc.strerror}") from None
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only then (else ~40 ms a response).
    listener = socket.socket(family, kind, proto)
    # As uvicorn does: a restarted server binds while its old connections sit in TIME_WAIT.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as exc:
        listener.close()
        if exc.errno == errno.EADDRINUSE:
            raise RerankitError(f"port {port} on {host} is in use") from None
        raise RerankitError(f"cannot listen on port {port} of {host}: {exc.strerror}") from None
    return listener


def raise_open_files_limit(needed: int) -> None:
    """Lift the soft limit of open files to ``needed`` where the hard limit allows (a connection is a file)."""
    try:
        import resource
    except ImportError:  # Windows: no such limit to lift
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else min(needed, hard),
                                                    hard))


