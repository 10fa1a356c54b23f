"""The fair work queue behind the batcher: requests cut into chunks, engine calls filled least-served first.

A request's items are cut into chunks of consecutive items of at most ``chunk_tokens`` estimated tokens (one item
over it is a chunk of its own). An engine call takes at most one chunk of each waiting request, until the call's
budget of items and tokens is full: the lowest priority first, then the caller, and that caller's request, that
have had the fewest tokens scored so far (arrival order breaks ties; ``FairQueue``). So a 2-doc request that
arrives behind a 1,000-doc one waits for one chunk of it, not for all of it; a lone large request runs as a series
of calls of one chunk, each of which a newcomer can join; and a caller that sends a hundred requests at once has
one share, as a caller with one request has. Each chunk
goes to the engine as the request's own ``ScoreRequest`` over its slice of items (same query, same options): its
items still share the request's prefix (MIS) inside the call. Results come back per chunk and are put together in
input order; the first chunk that fails fails its request, once.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass

from rerankit.errors import shift_item_index
from rerankit.estimate import item_tokens
from rerankit.schema import ScoreRequest, ScoreResponse


def estimate_tokens(request: ScoreRequest, cap: int | None = None) -> int:
    """About how many tokens scoring ``request`` feeds the model, for the budgets and the per-request limit."""
    return sum(item_tokens(request, cap))


def power_of_two_floor(value: int) -> int:
    """The largest power of two not above ``value`` (>= 1): budgets are bucketed so calls take few shapes."""
    return 1 << (max(1, value).bit_length() - 1)


@dataclass(frozen=True)
class Chunk:
    """Items ``start:end`` of a request, about ``tokens`` tokens."""

    start: int
    end: int
    tokens: int


def split(tokens: list[int], chunk_tokens: int, chunk_items: int) -> list[Chunk]:
    """Consecutive items in chunks of at most ``chunk_tokens`` tokens and ``chunk_items`` items (at least one)."""
    chunks: list[Chunk] = []
    start = total = 0
    for index, count in enumerate(tokens):
        if index > start and (total + count > chunk_tokens or index - start >= chunk_items):
            chunks.append(Chunk(start, index, total))
            start, total = index, 0
        total += count
    chunks.append(Chunk(start, len(tokens), total))
    return chunks


class Submission:
    """One request in the queue: its chunks still to run, the results of those done, and its caller's future."""

    _arrivals = itertools.count()

    def __init__(self, request: ScoreRequest, chunks: list[Chunk], future: asyncio.Future,
                 request_id: str | None = None, trace_context: object = None, caller: str = "") -> None:
        self.request = request
        self.caller = caller  # whose request: the fair share is per caller first (``FairQueue``)
        self.request_id = request_id  # its HTTP request's X-Request-Id: logged, and forwarded by a proxy
        self.trace_context = trace_context  # its OpenTelemetry context, for a proxied call to continue its trace
        self.queued_ns = time.time_ns()
        self.started_ns: int | None = None  # when its first chunk went into an engine call
        self.calls = 0  # engine calls that took a chunk of it
        self.future = future
        self.waiting: deque[Chunk] = deque(chunks)
        self.whole = len(chunks) == 1
        self.running = 0  # chunks in an engine call now
        self.served = 0  # the fairness key: where it started in the queue, plus the tokens handed out since
        self.arrival = next(self._arrivals)
        self.done: list[tuple[int, ScoreResponse]] = []  # (chunk's first item, its response) of chunks answered

    @property
    def priority(self) -> int:
        """The request's ``priority``: lower goes first (vLLM's and Cohere's field)."""
        return self.request.priority

    @property
    def gone(self) -> bool:
        """Answered, failed or cancelled: nothing of it needs to run any more."""
        return self.future.done()

    def take(self) -> "Piece":
        """Hand its next chunk to an engine call."""
        chunk = self.waiting.popleft()
        self.running += 1
        self.calls += 1
        if self.started_ns is None:
            self.started_ns = time.time_ns()
        self.served += chunk.tokens
        return Piece(self, chunk)

    def deliver(self, chunk: Chunk, outcome: ScoreResponse | BaseException) -> None:
        """Take one chunk's outcome; answer the caller once every chunk is in, or at the first error."""
        self.running -= 1
        if self.gone:
            return
        if isinstance(outcome, BaseException):  # an item named by the chunk's count is named by the request's
            self.future.set_exception(outcome if self.whole else shift_item_index(outcome, chunk.start))
            return
        if self.whole:
            self.future.set_result(outcome)
            return
        self.done.append((chunk.start, outcome))
        if not self.waiting and not self.running:
            try:
                joined = ScoreResponse.joined(self.done)
            except ValueError:  # a gap or an overlap
                joined = None
            if joined is None or len(joined.results) != len(self.request.items):
                self.future.set_exception(RuntimeError("the engine did not return a score for every item"))
            else:
                self.future.set_result(joined)


@dataclass(frozen=True)
class Piece:
    """One chunk of one submission in an engine call."""

    submission: Submission
    chunk: Chunk

    def request(self) -> ScoreRequest:
        """What the engine scores: the request itself, or its slice of items with the same query and options."""
        return self.submission.request.with_items(self.chunk.start, self.chunk.end)


class FairQueue:
    """The requests with chunks still to run, and the rule that fills an engine call from them.

    An engine call takes at most one chunk of each request. The order: the lowest ``priority`` first; then the
    least-served caller (tokens handed out to its requests); then that caller's least-served request (its key: where
    it started, plus the tokens handed out to it since); then the oldest. Requests and callers start level with the
    queue's progress, not at 0: a newcomer takes turns with those already served instead of waiting for them, and
    cannot starve them either. A caller that floods the queue with requests gets one share, as a lone request of
    another caller does.
    """

    def __init__(self) -> None:
        self._submissions: list[Submission] = []
        self._virtual = 0  # the fairness key reached: that of the last chunk taken, after it
        self._callers: dict[str, int] = {}  # the served tokens of each caller with requests queued
        self._caller_virtual = 0  # the same for callers

    def __len__(self) -> int:
        return len(self._submissions)

    @property
    def chunks(self) -> int:
        """Chunks waiting for an engine call."""
        return sum(len(submission.waiting) for submission in self._submissions)

    def add(self, submission: Submission) -> None:
        """Queue a submission. It starts at the key the queue has reached (level with a large request that has just
        had a chunk, and after it, being newer), not at 0: new requests then take turns with a large one that has
        already been served some, instead of starving it. A caller with nothing queued starts so too."""
        submission.served = self._virtual
        self._callers.setdefault(submission.caller, self._caller_virtual)
        self._submissions.append(submission)

    def remove(self, submission: Submission) -> None:
        """Drop a submission's waiting chunks (its caller left, or it failed); chunks running finish."""
        if submission in self._submissions:
            self._submissions.remove(submission)
            self._forget_idle_callers()
        submission.waiting.clear()

    def drain(self) -> list[Submission]:
        """Every submission still queued, removed."""
        taken, self._submissions = self._submissions, []
        self._callers.clear()
        return taken

    def sheddable(self, priority: int = 0) -> Submission | None:
        """The queued request to answer 429 to make room for one of ``priority``: of those none of whose chunks
        has run yet and whose priority is a higher number, the highest, the newest first; None when there is none."""
        candidates = [submission for submission in self._submissions
                      if submission.started_ns is None and not submission.gone and submission.priority > priority]
        return max(candidates, key=lambda submission: (submission.priority, submission.arrival), default=None)

    def holds_at_least(self, items: int, tokens: int) -> bool:
        """Whether the next chunks of the waiting requests fill a call of ``items`` items or ``tokens`` tokens."""
        heads = [submission.waiting[0] for submission in self._submissions if submission.waiting]
        return (sum(chunk.end - chunk.start for chunk in heads) >= items
                or sum(chunk.tokens for chunk in heads) >= tokens)

    def take(self, max_items: int, max_tokens: int, max_requests: int | None = None) -> list[Piece]:
        """The next engine call: one chunk of each request, in the class docstring's order, while the budget holds
        (the first chunk always goes, so a chunk over the budget on its own still runs, alone)."""
        self._submissions = [submission for submission in self._submissions if not submission.gone]
        queues: dict[str, deque[Submission]] = {}
        for submission in sorted(self._submissions, key=lambda entry: (entry.priority, entry.served, entry.arrival)):
            queues.setdefault(submission.caller, deque()).append(submission)
        def turn(caller: str) -> tuple[int, int, int, int, str]:  # the caller's place: its next request's
            head = queues[caller][0]
            return head.priority, self._callers[caller], head.served, head.arrival, caller

        turns = [turn(caller) for caller in queues]  # a heap: O(log callers) a chunk, whoever many callers wait
        heapq.heapify(turns)
        pieces: list[Piece] = []
        items = tokens = 0
        while turns:
            caller = heapq.heappop(turns)[-1]
            submission = queues[caller].popleft()
            chunk = submission.waiting[0]
            size = chunk.end - chunk.start
            if not pieces or (items + size <= max_items and tokens + chunk.tokens <= max_tokens):
                pieces.append(submission.take())
                self._virtual = max(self._virtual, submission.served)
                self._callers[caller] += chunk.tokens
                self._caller_virtual = max(self._caller_virtual, self._callers[caller])
                items, tokens = items + size, tokens + chunk.tokens
                if max_requests is not None and len(pieces) >= max_requests:
                    break
            # else a smaller chunk further on may still fit
            if queues[caller]:
                heapq.heappush(turns, turn(caller))
        self._submissions = [submission for submission in self._submissions if submission.waiting]
        self._forget_idle_callers()
        return pieces

    def _forget_idle_callers(self) -> None:
        """Callers with nothing queued keep no credit: when they come back they start level with the queue."""
        queued = {submission.caller for submission in self._submissions}
        for caller in [caller for caller in self._callers if caller not in queued]:
            del self._callers[caller]
