"""Server metrics in the Prometheus text format (0.0.4), without a client library.

All updates happen on the event loop's thread (routes and the batcher's dispatcher), so no lock is needed. The
data-parallel replicas' figures are the backend's own (``DataParallelBackend.replica_status``), read at each scrape.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from typing import Any, Callable, Sequence

# up to minutes: a large request on a CPU, or one queued behind others under load, runs that long
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                     300.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# A data-parallel replica's states (``ReplicaStatus.state``): every one is reported, at 0 too, so alerts find them.
REPLICA_STATES = ("ready", "starting", "down")


def replica_counts(replicas: Sequence[Any]) -> dict[str, int]:
    """How many of ``replicas`` (``ReplicaStatus``) are in each state."""
    states = [replica.state for replica in replicas]
    return {state: states.count(state) for state in REPLICA_STATES}


class Histogram:
    """Cumulative-bucket histogram, as Prometheus expects it."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        out, cumulative = [], 0
        sep = "," if labels else ""
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {cumulative}')
        braces = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{braces} {self.total}")
        out.append(f"{name}_count{braces} {self.count}")
        return out


class Metrics:
    """Requests, items, tokens, latency per route; batches sent to the engine; queue depth; with ``replicas`` (a
    data-parallel backend's ``replica_status``), its replicas by state and their failures."""

    def __init__(self, queue_depth: Callable[[], int], queue_chunks: Callable[[], int],
                 replicas: Callable[[], Sequence[Any]] | None = None) -> None:
        self.queue_depth = queue_depth
        self.queue_chunks = queue_chunks
        self.replicas = replicas
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.items: dict[str, int] = defaultdict(int)
        self.prompt_tokens: dict[str, int] = defaultdict(int)
        self.latency: dict[str, Histogram] = {}
        self.batches = 0
        self.cancelled = 0
        self.held_calls = 0
        self.stopped_calls = 0
        self.shed = 0
        self.batch_requests = Histogram(BATCH_SIZE_BUCKETS)
        self.batch_items = Histogram(tuple(size * 8 for size in BATCH_SIZE_BUCKETS))

    def observe_request(self, route: str, status: int, seconds: float, items: int = 0,
                        prompt_tokens: int = 0) -> None:
        """Count one finished HTTP request on a scoring route (any status)."""
        self.requests[(route, status)] += 1
        self.items[route] += items
        self.prompt_tokens[route] += prompt_tokens
        self.latency.setdefault(route, Histogram(LATENCY_BUCKETS_S)).observe(seconds)

    def observe_batch(self, requests: int, items: int) -> None:
        """Count one batch of ``requests`` requests holding ``items`` items, sent to the engine."""
        self.batches += 1
        self.batch_requests.observe(requests)
        self.batch_items.observe(items)

    def observe_cancelled(self) -> None:
        """Count one request whose caller went away before it was answered (not a status: nobody read one)."""
        self.cancelled += 1

    def render(self) -> str:
        """The metrics page, Prometheus text format."""
        lines = ["# HELP rerankit_requests_total Scoring requests by route and HTTP status.",
                 "# TYPE rerankit_requests_total counter"]
        lines += [f'rerankit_requests_total{{route="{route}",status="{status}"}} {count}'
                  for (route, status), count in sorted(self.requests.items())]
        lines += ["# HELP rerankit_items_total Items scored, by route.", "# TYPE rerankit_items_total counter"]
        lines += [f'rerankit_items_total{{route="{route}"}} {count}' for route, count in sorted(self.items.items())]
        lines += ["# HELP rerankit_prompt_tokens_total Prompt tokens scored (as if each pair ran alone), by route.",
                  "# TYPE rerankit_prompt_tokens_total counter"]
        lines += [f'rerankit_prompt_tokens_total{{route="{route}"}} {count}'
                  for route, count in sorted(self.prompt_tokens.items())]
        lines += ["# HELP rerankit_request_duration_seconds Time from request received to response ready.",
                  "# TYPE rerankit_request_duration_seconds histogram"]
        for route, histogram in sorted(self.latency.items()):
            lines += histogram.lines("rerankit_request_duration_seconds", f'route="{route}"')
        lines += ["# HELP rerankit_queue_depth Requests with chunks waiting for the engine.",
                  "# TYPE rerankit_queue_depth gauge",
                  f"rerankit_queue_depth {self.queue_depth()}",
                  "# HELP rerankit_queue_chunks Chunks of the waiting requests, each at most one engine call's share.",
                  "# TYPE rerankit_queue_chunks gauge", f"rerankit_queue_chunks {self.queue_chunks()}",
                  "# HELP rerankit_batches_total Batches sent to the engine (one call each with score_batch).",
                  "# TYPE rerankit_batches_total counter",
                  f"rerankit_batches_total {self.batches}",
                  "# HELP rerankit_cancelled_total Requests dropped because their client went away.",
                  "# TYPE rerankit_cancelled_total counter", f"rerankit_cancelled_total {self.cancelled}",
                  "# HELP rerankit_shed_total Queued requests answered 429 to make room for one of higher priority.",
                  "# TYPE rerankit_shed_total counter", f"rerankit_shed_total {self.shed}",
                  "# HELP rerankit_batches_held_total Engine calls held back (batch window) for more requests.",
                  "# TYPE rerankit_batches_held_total counter", f"rerankit_batches_held_total {self.held_calls}",
                  "# HELP rerankit_batches_stopped_total Engine calls stopped early: every caller had gone.",
                  "# TYPE rerankit_batches_stopped_total counter",
                  f"rerankit_batches_stopped_total {self.stopped_calls}",
                  "# HELP rerankit_batch_requests Requests in one batch.",
                  "# TYPE rerankit_batch_requests histogram"]
        lines += self.batch_requests.lines("rerankit_batch_requests")
        lines += ["# HELP rerankit_batch_items Items in one batch.", "# TYPE rerankit_batch_items histogram"]
        lines += self.batch_items.lines("rerankit_batch_items")
        if self.replicas is not None:
            lines += self.replica_lines(self.replicas())
        return "\n".join(lines) + "\n"

    @staticmethod
    def replica_lines(replicas: Sequence[Any]) -> list[str]:
        """The data-parallel replicas' metrics: how many are in each state, and each one's failures by cause."""
        lines = ["# HELP rerankit_replicas Data-parallel engine replicas by state: ready (taking work), starting "
                 "(loading the model, at start or after a failure, or pausing before a restart), down (failed too "
                 "often within a window; started once more after a wait).",
                 "# TYPE rerankit_replicas gauge"]
        lines += [f'rerankit_replicas{{state="{state}"}} {count}' for state, count in replica_counts(replicas).items()]
        lines += ["# HELP rerankit_replica_failures_total Data-parallel replica failures by replica and cause: died "
                  "(its process ended), timed_out (killed after replica_timeout_s without a reply), failed_to_start "
                  "(ended, failed to load, or was still loading startup_timeout_s after its start).",
                  "# TYPE rerankit_replica_failures_total counter"]
        lines += [f'rerankit_replica_failures_total{{replica="{replica.index}",cause="{cause}"}} {count}'
                  for replica in replicas for cause, count in replica.failures.items()]
        return lines
