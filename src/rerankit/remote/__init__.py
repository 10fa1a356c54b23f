"""The remote path: score on a vLLM, SGLang, Cohere-style or TEI server, or on ``rerankit serve``.

Nothing here imports torch: ``pip install rerankit`` is enough to use a server.
"""

from rerankit.remote.backend import RemoteBackend
from rerankit.remote.client import ClientConfig, Timeout
from rerankit.remote.dialects import DIALECTS, Dialect, get_dialect

__all__ = ["ClientConfig", "DIALECTS", "Dialect", "RemoteBackend", "Timeout", "get_dialect"]
