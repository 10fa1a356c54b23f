"""httpx clients without a fresh default SSL context each (test speed only).

Every ``httpx.Client`` / ``AsyncClient`` (and so every ``httpx.get`` / ``httpx.post`` without a client) builds an
``ssl.SSLContext`` for its transport and loads a CA bundle into it (certifi's, or the one ``SSL_CERT_FILE`` /
``SSL_CERT_DIR`` names), ~15-17 ms on the 2-core box, even for the plain-HTTP loopback servers these tests talk to:
about a thousand times a run, ~15-20 s of the suite (7 s of it in ``tests/remote/test_proxy_chain.py``).

Here the context of the default settings (``verify=True``, no client certificate) is built once per
``trust_env``, ``http2``, ``SSLKEYLOGFILE`` and bundle (its path, inode, size and modification time) and then
shared, as one client shares it among its connections; other settings (a CA file or context passed as ``verify``,
``verify=False``, a client certificate) build their own context as before. Nothing changes what a connection
verifies. Installed only over the httpx API it was written against (``httpx._config.SSLConfig.load_ssl_context``,
httpx < 0.28); RERANKIT_TESTS_STOCK_HTTPX=1 turns it off.
"""

from __future__ import annotations

import os
import threading


def install() -> bool:
    """Install the shared default context; whether it is in place."""
    if os.environ.get("RERANKIT_TESTS_STOCK_HTTPX") == "1":
        return False
    try:
        import httpx._config as config
    except ImportError:
        return False
    ssl_config = getattr(config, "SSLConfig", None)
    stock = getattr(ssl_config, "load_ssl_context", None)
    from_env = getattr(config, "get_ca_bundle_from_env", None)
    if stock is None or from_env is None or getattr(stock, "shared_default", False):
        return False
    contexts: dict = {}
    lock = threading.Lock()

    def load_ssl_context(self):
        if self.verify is not True or self.cert is not None:
            return stock(self)
        bundle = from_env() if self.trust_env else None
        try:
            found = None if bundle is None else os.stat(bundle)
        except OSError:
            return stock(self)
        key = (self.trust_env, self.http2, os.environ.get("SSLKEYLOGFILE") if self.trust_env else None, bundle,
               None if found is None else (found.st_ino, found.st_size, found.st_mtime_ns))
        with lock:
            if key not in contexts:
                contexts[key] = stock(self)
            return contexts[key]

    load_ssl_context.shared_default = True
    ssl_config.load_ssl_context = load_ssl_context
    return True
