"""The ``Backend`` protocol: the one seam between the adapters and whatever does the scoring."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from rerankit.schema import ScoreRequest, ScoreResponse


@runtime_checkable
class Backend(Protocol):
    """Scores a ``ScoreRequest``; embedded engines and remote clients both implement it."""

    @property
    def model_name(self) -> str:
        """The model this backend scores with (a path, hub id, or the remote server's model)."""
        ...

    def score(self, request: ScoreRequest) -> ScoreResponse:
        """Score every item of ``request``; one result per item, in input order."""
        ...

    async def ascore(self, request: ScoreRequest) -> ScoreResponse:
        """Async twin of ``score`` that does not block the event loop."""
        ...

    def close(self) -> None:
        """Release the model or the connection pool."""
        ...
