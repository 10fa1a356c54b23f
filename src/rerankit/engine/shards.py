"""Cutting a call's requests into shards for data-parallel replicas, and putting the answers back together.

A shard is a contiguous run of one request's items (same query and options), so that each replica still shares the
request's prefix among the items it gets. Tokens are estimated from bytes (the parent does not tokenize): the plan
only has to balance the replicas, not to be exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rerankit.errors import RerankitError, shift_item_index
from rerankit.estimate import item_tokens
from rerankit.schema import ScoreRequest, ScoreResponse

# A request is cut only into shards of at least this many estimated tokens: below it a replica's call is bound by
# its fixed cost (launches, the prefix computed again), so a cut would add latency instead of taking it away.
MIN_SHARD_TOKENS = 2048


@dataclass(frozen=True)
class Shard:
    """Items ``start:stop`` of request ``position`` of a call, about ``tokens`` tokens."""

    position: int
    start: int
    stop: int
    tokens: int

    def request_of(self, requests: list[ScoreRequest]) -> ScoreRequest:
        """The sub-request this shard scores (the whole request when it is not cut)."""
        return requests[self.position].with_items(self.start, self.stop)


def cut(requests: list[ScoreRequest], replicas: int) -> list[Shard]:
    """Shards of ``requests`` for ``replicas`` replicas: a request above an even share of the call's tokens is cut
    into contiguous runs of about that share (never below ``MIN_SHARD_TOKENS``); the others stay whole."""
    per_request = [item_tokens(request) for request in requests]
    share = max(MIN_SHARD_TOKENS, math.ceil(sum(map(sum, per_request)) / max(1, replicas)))
    shards: list[Shard] = []
    for position, tokens in enumerate(per_request):
        pieces = min(replicas, len(tokens), max(1, round(sum(tokens) / share)))
        shards.extend(_even_runs(position, tokens, pieces))
    return shards


def _even_runs(position: int, tokens: list[int], pieces: int) -> list[Shard]:
    """``pieces`` contiguous runs of ``tokens`` with about equal sums (each at least one item)."""
    total = sum(tokens)
    runs: list[Shard] = []
    start = running = 0
    for stop, count in enumerate(tokens, start=1):
        running += count
        left = pieces - len(runs) - 1  # cuts still to make
        if left and running >= total * (len(runs) + 1) / pieces and len(tokens) - stop >= left:
            runs.append(Shard(position, start, stop, sum(tokens[start:stop])))
            start = stop
    runs.append(Shard(position, start, len(tokens), sum(tokens[start:])))
    return runs


def merge(requests: list[ScoreRequest], shards: list[Shard],
          outcomes: list[ScoreResponse | RerankitError]) -> list[ScoreResponse | RerankitError]:
    """One outcome per request from its shards' outcomes: results in input order (indexes rebased), usage summed;
    the first failed shard's error stands for its request, an ``items[k]`` it names counted from the request's
    first item."""
    parts: list[list[tuple[Shard, ScoreResponse | RerankitError]]] = [[] for _ in requests]
    for shard, outcome in zip(shards, outcomes):
        parts[shard.position].append((shard, outcome))
    merged: list[ScoreResponse | RerankitError] = []
    for position, pieces in enumerate(parts):
        pieces.sort(key=lambda piece: piece[0].start)
        error = next((outcome for _, outcome in pieces if isinstance(outcome, BaseException)), None)
        if error is not None:
            start = next(shard.start for shard, outcome in pieces if outcome is error)
            merged.append(shift_item_index(error, start))
            continue
        merged.append(pieces[0][1] if len(pieces) == 1 else
                      ScoreResponse.joined([(shard.start, response) for shard, response in pieces]))
    assert all(len(getattr(outcome, "results", request.items)) == len(request.items)
               for request, outcome in zip(requests, merged)), "a shard lost or repeated items"
    return merged
