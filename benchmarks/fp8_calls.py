"""Pairs/s of FP8 calls alone on one shape, for A/B runs of two builds: run it once per build (its ``src`` on
PYTHONPATH), alternating, on the same GPU; the model folder is built once and shared (``--build`` first).

    PYTHONPATH=src python benchmarks/fp8_calls.py --shape 4b --root /tmp/fp8 --build
    PYTHONPATH=src python benchmarks/fp8_calls.py --shape 4b --root /tmp/fp8 --docs 32 --tag new
    PYTHONPATH=../before/src python benchmarks/fp8_calls.py --shape 4b --root /tmp/fp8 --docs 32 --tag before

Each run warms up with three calls, then prints the medians of three rounds of 15 calls (W1's query and its
``--docs`` documents, as ``pairs.py`` builds them). ``$RERANKIT_FP8_PROJECTIONS`` picks the projections.

``--projections "qkv,gate_up;qkv,gate_up,down"`` loads one backend per choice of projections in the one process
and alternates them round by round (``--rounds`` each): an A/B of defaults without the spread between processes.
``--env "RERANKIT_QKV_KERNEL=triton;"`` does the same for environment settings (each set while its backend loads,
warms up and runs), e.g. the Triton q/k/v kernel against the warp-specialized one.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pairs import build_decoder_dir, decoder_workloads, requests_of, single_token_words, time_call  # noqa: E402

ROUNDS, CALLS, WARM_UP_CALLS = 3, 15, 3


@contextlib.contextmanager
def environment(settings: dict[str, str]):
    """``settings`` in the environment for the block; each variable's earlier value (or absence) after it."""
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", required=True, help="0.6b, 4b or 8b (pairs.py's SHAPES)")
    parser.add_argument("--root", required=True, help="folder of the random-weight model")
    parser.add_argument("--build", action="store_true", help="build the model folder and stop")
    parser.add_argument("--docs", type=int, default=32, help="documents of the query (W1 has 100)")
    parser.add_argument("--tag", default="", help="a name for this build in the output line")
    parser.add_argument("--projections", default=None,
                        help="semicolon-separated choices of $RERANKIT_FP8_PROJECTIONS, alternated in one process")
    parser.add_argument("--env", default=None,
                        help="semicolon-separated choices of comma-separated NAME=VALUE settings, alternated in one "
                             "process (an empty choice: the environment as it is); a value may hold commas, e.g. "
                             "RERANKIT_FP8_PROJECTIONS=qkv,o,gate_up,down,RERANKIT_LAUNCH_REPLAY=1")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds of 15 calls for each backend")
    args = parser.parse_args()
    if args.build:
        build_decoder_dir(Path(args.root), args.shape)
        return
    from transformers import AutoTokenizer

    from rerankit.engine.backend import EmbeddedBackend

    folder = Path(args.root) / f"qwen3-reranker-{args.shape}-random"
    words = single_token_words(AutoTokenizer.from_pretrained(folder))
    requests = requests_of(decoder_workloads(words, random.Random(0), {"W1"}, args.docs)[0], True)
    if args.projections is not None:  # read when the backend loads
        choices = {choice: {"RERANKIT_FP8_PROJECTIONS": choice} for choice in args.projections.split(";")}
    elif args.env is not None:  # read when the backend loads, or on each call
        choices = {choice: dict(pair.split("=", 1) for pair in re.split(r",(?=\w+=)", choice) if pair)
                   for choice in args.env.split(";")}
    else:
        choices = {None: {}}
    backends = {}
    for choice, settings in choices.items():
        with environment(settings):
            backends[choice] = EmbeddedBackend(str(folder), device="cuda", dtype="fp8")
            for _ in range(WARM_UP_CALLS):
                backends[choice].score_batch(requests)
    rates: dict = {choice: [] for choice in choices}
    for _ in range(args.rounds):
        for choice, backend in backends.items():
            with environment(choices[choice]):
                call = functools.partial(backend.score_batch, requests)
                rates[choice].append(args.docs / statistics.median(time_call(call, CALLS)))
    for choice, values in rates.items():
        print(f"fp8 {args.shape} {args.tag or choice or ''} pairs/s {' '.join(f'{rate:.1f}' for rate in values)} "
              f"median {statistics.median(values):.1f}", flush=True)


if __name__ == "__main__":
    main()
