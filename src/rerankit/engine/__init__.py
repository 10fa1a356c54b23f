"""The embedded engine: encode -> plan -> run -> heads, behind ``EmbeddedBackend``. Needs torch and transformers."""

from rerankit.engine.backend import EmbeddedBackend

__all__ = ["EmbeddedBackend"]
