"""Warm-up of a packed runner before a server says it is ready: every shape that traffic commonly forms is compiled,
tuned and captured here, so that none of it happens on a request's path.

Three things run on a model's first batch of a new shape: ``torch.compile`` of the per-layer steps (dynamic shapes,
but specialised per path), Triton's autotuning of the large-batch GEMMs (once per weight shape, at the first batch
over ``FUSED_QKV_ROPE_MIN_TOKENS``) and a CUDA graph capture per padded shape (``engine.graphs``: two eager
forwards and a capture). Under load a server forms calls of every size, so each of those met its first requests:
on an H100 with the Qwen3-0.6B shape, the first 15 s after ready at 16 clients had a p50 of 8.3 s.

Warm-up runs synthetic batches of token ids (their values do not matter: the kernels never branch on them) for
each graph key a server meets (every token bucket up to ``MAX_GRAPH_TOKENS``, 1-15 sequences, short and long keys
per query) and a few eager sizes above it (aligned and odd token counts, one and many sequences), then freezes the
graphs: a shape that warm-up did not capture runs eagerly, never captured on a request's path.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator

from rerankit.engine.batch import PackedBatch
from rerankit.engine.encode import Sequence
from rerankit.engine.graphs import TOKEN_BUCKETS, graph_key
from rerankit.engine.plan import pack
from rerankit.kernels.attention_config import LONG_KEYS_PER_QUERY

log = logging.getLogger("rerankit.engine")

# Real sequences of a warm-up batch: with the padding's own sequence, graph keys of 2, 4, ... sequences. A decoder
# shares each request's prefix among its items (one sequence a request); an encoder runs one sequence a pair.
SEQUENCE_COUNTS = {True: (1, 3, 7, 15), False: (1, 3, 7, 15, 31, 63)}
MIN_SEQUENCE_TOKENS = 64  # shorter sequences are not worth a graph key of their own
LONG_SEQUENCE_TOKENS = 2 * LONG_KEYS_PER_QUERY  # a causal sequence this long can see long keys per query on average
# Eager sizes: (tokens, sequences); odd and aligned counts (Triton specialises on divisibility by 16), on both sides
# of the decoder's large-batch paths (``FUSED_QK_MIN_TOKENS`` 12,288; ``FUSED_QKV_ROPE_MIN_TOKENS`` 8,192), and
# below the graphs' sizes too: a shape that warm-up did not capture runs eagerly, through steps compiled for it.
EAGER_SHAPES = ((1000, 3), (4095, 7), (9216, 2), (10001, 5), (12289, 1), (16384, 8), (24575, 3), (32768, 16))


def synthetic_batch(tokens: int, sequences: int, max_length: int, *, causal: bool, typed: bool,
                    long_keys: bool) -> PackedBatch:
    """``sequences`` sequences of ``tokens`` token ids in all, each read at its last token; ``long_keys`` marks the
    batch as one whose queries see long keys (a long shared prefix), which picks another attention tile. Positions
    stay below ``max_length``, wrapping as a shared prefix's items restart theirs."""
    lengths = [tokens // sequences + (index < tokens % sequences) for index in range(sequences)]
    batch = pack([Sequence(index, [1 + (position % 97) for position in range(length)],
                           [0] * length if typed else None, length - 1)
                  for index, length in enumerate(lengths)], causal=causal)
    return dataclasses.replace(batch, position_ids=batch.position_ids % max_length,
                               keys_per_query=float(LONG_KEYS_PER_QUERY if long_keys else 0))


def graph_batches(max_tokens: int, max_length: int, *, causal: bool, typed: bool) -> Iterator[PackedBatch]:
    """One batch per graph key of a common shape: every bucket up to ``max_tokens`` (one token short of it, as real
    batches are, so the padding's own sequence is counted) by ``SEQUENCE_COUNTS`` (an encoder's sequences of at most
    ``max_length`` tokens), with short keys per query, and long ones where a causal sequence can have them."""
    seen = set()
    for bucket in (bucket for bucket in TOKEN_BUCKETS if bucket <= max_tokens):
        for sequences in SEQUENCE_COUNTS[causal]:
            length = (bucket - 1) // sequences
            if length < MIN_SEQUENCE_TOKENS or (not causal and length > max_length):
                continue
            long_variants = (False, True) if causal and (bucket - 1) // sequences >= LONG_SEQUENCE_TOKENS else (False,)
            for long_keys in long_variants:
                batch = synthetic_batch(bucket - 1, sequences, max_length, causal=causal, typed=typed,
                                        long_keys=long_keys)
                key = graph_key(batch, read=True, max_tokens=max_tokens)
                if key not in seen:
                    seen.add(key)
                    yield batch


def eager_batches(max_length: int, *, causal: bool, typed: bool) -> Iterator[PackedBatch]:
    """Batches above the graphs' sizes (an encoder's sequences of at most ``max_length`` tokens): they compile the
    eager paths and tune the large-batch GEMMs."""
    for tokens, sequences in EAGER_SHAPES:
        if not causal:  # an encoder's sequence is one pair, within its positions
            sequences = max(sequences, -(-tokens // max_length))
        yield synthetic_batch(tokens, sequences, max_length, causal=causal, typed=typed, long_keys=False)
    if causal:
        yield synthetic_batch(EAGER_SHAPES[0][0], 1, max_length, causal=causal, typed=typed, long_keys=True)


def warm_up_runner(runner, max_length: int, *, causal: bool, typed: bool, every_token: bool) -> dict[str, float]:
    """Run the warm-up batches (positions below ``max_length``, the model's) through ``runner``
    (a ``PackedRunner``): the read rows' forward and, for models whose heads pool every token (``every_token``), the
    full forward too; then freeze its graphs. Returns what it did."""
    begun = time.perf_counter()
    graphs = runner.graphs
    captured_before = graphs.captures if graphs is not None else 0
    eager = list(eager_batches(max_length, causal=causal, typed=typed))
    runner.graphs = None  # sizes below the graphs' run eagerly here, as a shape without a graph will later
    try:
        for batch in eager:
            _run(runner, batch, every_token)
    finally:
        runner.graphs = graphs
    captured = list(graph_batches(graphs.max_tokens, max_length, causal=causal, typed=typed)) if graphs else []
    for batch in captured:
        _run(runner, batch, every_token)
    graphs = runner.graphs  # None if a capture failed (the runner then runs without graphs)
    captures = graphs.captures - captured_before if graphs is not None else 0
    if graphs is not None:
        graphs.frozen = True
    seconds = time.perf_counter() - begun
    shapes = len(eager) + len(captured)
    log.info("warmed up %d batch shapes (%d CUDA graphs captured) in %.1f s", shapes, captures, seconds)
    return {"batches": shapes, "captures": captures, "seconds": seconds}


def _run(runner, batch: PackedBatch, every_token: bool) -> None:
    runner.forward_read(batch)
    if every_token:
        runner.forward(batch)
