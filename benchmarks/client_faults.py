"""Rows 6-9 of issue 20, the remote client against misbehaving loopback servers: how long a call takes, what it
returns, and the memory a huge reply costs. Run it once per source tree to compare two versions of the client:

    PYTHONPATH=src python benchmarks/client_faults.py
    PYTHONPATH=/path/to/old/src python benchmarks/client_faults.py

Probes: (6) a server dripping its reply a byte a second, timeout=2, then also deadline=2; (7) ten calls to
[ok, hanging] with timeout=2; (8) a NaN score; (9) a 200 MB reply (peak RSS growth; run last, as ru_maxrss is a peak).
Each probe is stopped after PROBE_LIMIT seconds (a thread left behind, its time reported as "> limit").
"""

from __future__ import annotations

import inspect
import resource
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "remote"))

from fault_server import FaultServer, items  # noqa: E402

from rerankit.remote import RemoteBackend  # noqa: E402
from rerankit.schema import ScoreRequest  # noqa: E402

PROBE_LIMIT = 60.0
REQUEST = ScoreRequest(query="q", items=items(1), label_token_ids=[1, 2])


def timed(remote: RemoteBackend) -> tuple[float, str]:
    """(seconds, outcome) of one call, given up on after PROBE_LIMIT."""
    outcome: list[str] = []

    def call() -> None:
        try:
            outcome.append(f"scores {remote.score(REQUEST).scores}")
        except Exception as error:  # the outcome to report, whatever it is
            outcome.append(f"{type(error).__name__}: {str(error)[:110]}")

    started = time.monotonic()
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(PROBE_LIMIT)
    took = time.monotonic() - started
    return (took, outcome[0]) if outcome else (took, f"still running after {PROBE_LIMIT:g} s")


def backend(urls, **options) -> RemoteBackend:
    """A vllm-generative client; options the client does not have (an older version) are left out."""
    known = inspect.signature(RemoteBackend).parameters
    return RemoteBackend(urls, dialect="vllm-generative", **{k: v for k, v in options.items() if k in known})


def main() -> None:
    drip = FaultServer(default="drip-ok", drip_seconds=1.0)
    for options in ({"timeout": 2}, {"timeout": 2, "deadline": 2}):
        took, outcome = timed(backend(drip.url, **options))
        print(f"6  drip 1 B/s, {options}: {took:.1f} s, {outcome}")
    drip.stop()

    ok, hanging = FaultServer(), FaultServer(default="hang")
    remote = backend([ok.url, hanging.url], timeout=2)
    times = [timed(remote)[0] for _ in range(10)]
    slow = sum(took > 1 for took in times)
    print(f"7  [ok, hanging] timeout=2, 10 calls: {sum(times):.1f} s in all, calls over 1 s: {slow}")

    nan = FaultServer(default="nan")
    print(f"8  NaN score: {timed(backend(nan.url))[1]}")

    huge = FaultServer(default="huge", huge_bytes=200 * 2**20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    took, outcome = timed(backend(huge.url, timeout=60))
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(f"9  200 MB reply: {took:.1f} s, peak RSS +{grown:.0f} MB, {outcome}")
    for server in (ok, hanging, nan, huge):
        server.stop()


if __name__ == "__main__":
    main()
