"""A fake backend for the server's tests that need no model: it records the engine calls it gets."""

from __future__ import annotations

import threading

from rerankit.errors import InvalidRequest
from rerankit.schema import ScoreRequest, ScoreResponse, ScoreResult, Usage


class RecordingBackend:
    """Scores each item by its length; records every engine call; can hold the first call on a gate."""

    model_name = "recording"

    def __init__(self, hold_first_call: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.requests: list[ScoreRequest] = []
        self.gate = threading.Event()
        self.entered = threading.Event()
        if not hold_first_call:
            self.gate.set()

    def _respond(self, request: ScoreRequest) -> ScoreResponse:
        if request.query == "bad":
            raise InvalidRequest("query", "is bad")
        results = [ScoreResult(index=index, score=float(len(item))) for index, item in enumerate(request.items)]
        tokens = sum(len(item) for item in request.items)
        return ScoreResponse(model=self.model_name, results=results,
                             usage=Usage(prompt_tokens=tokens, computed_tokens=tokens))

    def _record(self, requests: list[ScoreRequest]) -> None:
        self.calls.append([request.query for request in requests])
        self.requests.extend(requests)
        self.entered.set()
        self.gate.wait(10)

    def score(self, request: ScoreRequest) -> ScoreResponse:
        self._record([request])
        return self._respond(request)

    def score_batch(self, requests: list[ScoreRequest], *,
                    return_exceptions: bool = False) -> list[ScoreResponse | InvalidRequest]:
        """Like the engine's: a bad request fails the call, or, with ``return_exceptions``, takes its error back."""
        self._record(requests)
        outcomes: list[ScoreResponse | InvalidRequest] = []
        for request in requests:
            try:
                outcomes.append(self._respond(request))
            except InvalidRequest as error:
                if not return_exceptions:
                    raise
                outcomes.append(error)
        return outcomes

    async def ascore(self, request: ScoreRequest) -> ScoreResponse:
        return self.score(request)

    def close(self) -> None:
        pass
