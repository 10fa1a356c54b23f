"""rerankit: reranks retrieved documents for RAG pipelines, in-process on a GPU/CPU or over HTTP.

Importing rerankit never imports torch; the embedded engine loads on first use.
"""

from rerankit.backend import Backend
from rerankit.errors import (
    InvalidRequest,
    ModelLoadError,
    Overloaded,
    RemoteError,
    RequestTooLarge,
    RerankitError,
)
from rerankit.reranker import Reranker, make_backend
from rerankit.schema import RankedDocument, ScoreRequest, ScoreResponse, ScoreResult, Usage

__version__ = "0.1.0"

__all__ = [
    "Backend", "InvalidRequest", "ModelLoadError", "Overloaded", "RankedDocument", "RemoteError",
    "RequestTooLarge", "Reranker", "RerankitError", "ScoreRequest", "ScoreResponse", "ScoreResult", "Usage",
    "make_backend", "__version__",
]
