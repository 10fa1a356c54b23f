"""Test data for the adapters: a word-overlap fake backend (mapping tests) and a small corpus (real pipelines)."""

from __future__ import annotations

from rerankit.schema import ScoreRequest, ScoreResponse, ScoreResult

DOCUMENTS = [
    "Bananas are an excellent source of potassium.",
    "Paris is the capital and most populous city of France.",
    "A car engine converts the chemical energy of fuel into motion.",
    "The Louvre in Paris, the capital of France, is the most visited museum.",
    "Berlin is the capital of Germany.",
]
QUERY = "What is the capital of France?"


class WordOverlapBackend:
    """Scores an item by how many query words it holds; records each call so tests can check what reached it."""

    model_name = "word-overlap"

    def __init__(self) -> None:
        self.calls: list[tuple[str, ScoreRequest]] = []
        self.closed = False

    def _respond(self, request: ScoreRequest) -> ScoreResponse:
        query_words = set(_words(request.query))
        results = [ScoreResult(index=index, score=float(len(query_words & set(_words(item)))))
                   for index, item in enumerate(request.items)]
        return ScoreResponse(model=self.model_name, results=results)

    def score(self, request: ScoreRequest) -> ScoreResponse:
        self.calls.append(("score", request))
        return self._respond(request)

    async def ascore(self, request: ScoreRequest) -> ScoreResponse:
        self.calls.append(("ascore", request))
        return self._respond(request)

    def close(self) -> None:
        self.closed = True


def _words(text: str) -> list[str]:
    return [word.strip(".,?!").lower() for word in text.split()]

# A small corpus for the retrieval pipelines run with the real MiniLM.
CORPUS = [
    "Paris is the capital and most populous city of France.",
    "Bananas are an excellent source of potassium and vitamin B6.",
    "The Eiffel Tower was built in Paris for the 1889 World's Fair.",
    "A car engine converts the chemical energy of fuel into motion.",
    "France's capital hosts the Louvre, the world's most visited museum.",
    "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar.",
    "Berlin is the capital of Germany.",
    "The Amazon is the largest tropical rainforest on Earth.",
]
