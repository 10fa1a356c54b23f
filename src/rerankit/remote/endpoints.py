"""The server URLs of a remote backend: taken in turn, and set aside for a while when one fails to answer."""

from __future__ import annotations

import math
import threading
import time
from typing import Callable, Sequence

from rerankit.errors import InvalidRequest

# Each failure in a row of an endpoint doubles its cool-down, up to this many times the first.
_MAX_COOLDOWN_FACTOR = 8


class Endpoints:
    """Base URLs taken in turn (round-robin); one that refuses connections or times out goes last for a cool-down."""

    def __init__(self, urls: Sequence[str], cooldown: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not urls:
            raise InvalidRequest("urls", "give at least one server URL")
        self.urls = [url.rstrip("/") for url in urls]
        self._cooldown = cooldown
        self._clock = clock
        self._dead_until: dict[str, float] = {}
        self._strikes: dict[str, int] = {}
        self._turn = 0
        self._answered_at: float | None = None
        self._lock = threading.Lock()

    def order(self) -> list[str]:
        """Every URL: the live ones, starting with the next in turn, then those cooling down."""
        live = [url for url in self.urls if self.is_live(url)]
        cooling = [url for url in self.urls if url not in live]
        with self._lock:
            turn = self._turn
            self._turn += 1
        start = turn % len(live) if live else 0
        return live[start:] + live[:start] + cooling

    def is_live(self, url: str) -> bool:
        """False while ``url`` cools down after refusing a connection or timing out."""
        return self._dead_until.get(url, 0.0) <= self._clock()

    def mark_dead(self, url: str) -> None:
        """Send ``url`` to the back of the line; each failure in a row doubles the cool-down (up to 8x)."""
        with self._lock:
            # Tries already in flight when it was set aside fail too: they are the same failure, not a new one.
            if not self.is_live(url):
                return
            strikes = self._strikes.get(url, 0) + 1
            self._strikes[url] = strikes
            factor = min(2 ** (strikes - 1), _MAX_COOLDOWN_FACTOR)
            self._dead_until[url] = self._clock() + self._cooldown * factor

    def mark_live(self, url: str) -> None:
        """``url`` answered: it is live again (a try in flight when it was set aside has just succeeded), and its next
        failure starts from the first cool-down again."""
        self._answered_at = self._clock()
        if url in self._strikes or url in self._dead_until:
            with self._lock:
                self._strikes.pop(url, None)
                self._dead_until.pop(url, None)

    def since_answer(self) -> float:
        """Seconds since a request last got a successful answer from any URL (``inf`` before the first)."""
        answered = self._answered_at
        return math.inf if answered is None else self._clock() - answered
