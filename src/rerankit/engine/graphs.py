"""CUDA graphs for small micro-batches: one capture per padded shape, replayed for every batch that fits it.

A micro-batch of a few thousand tokens (W3: 1 query x 20 docs) is bound by the host, not the GPU: every layer
launches its compiled steps and Triton kernels from Python, about as slowly as the GPU runs them. Captured once,
the whole forward replays with one launch.

A graph has fixed shapes, so a batch is padded to a bucket: its tokens to the next of ``TOKEN_BUCKETS``, its
sequences and reads to the next power of two. The padding tokens form one extra sequence of their own (token id 0,
position 0, their own span), so no real token attends to them; extra sequences are empty; extra reads read token 0
and are dropped. The kernels never look at the batch on the host, so a replay is exact: the real rows of a padded
forward equal the unpadded forward's (tested on the CPU with ``pad_batch``; the replay itself on the GPU).

On by default on CUDA (``EmbeddedBackend(..., cuda_graphs=False)`` turns it off). H100, pairs.py --ab: W3 p50 17.8
ms replayed vs 29.3 ms launched eagerly. A new padded shape costs two eager warm-up forwards and a capture, once:
a server sees its first calls of each size slower. Captures run with ``graphed=True``, so the model picks the steps
that take least GPU time (launches are free at replay).

A batch whose sequences begin with a kept prompt head (``PackedBatch.cached_head``, ``engine.prefix_cache``) replays
from graphs of its own: their attention reads the head's keys and values from a slot of this object's (per layer,
``GraphKey.kept`` rows), into which the head's are copied when another head comes; ``cached_lens`` says how many
rows each sequence sees.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from rerankit.engine.batch import PackedBatch
from rerankit.engine.prefix_cache import CachedKV
from rerankit.kernels.attention_config import LONG_KEYS_PER_QUERY, takes_long_keys_tile

# Steps of 256 tokens up to 2,048, then of 512 up to 8,192, then of 1,024: a batch pays for at most ~10% of padding
# above 2k tokens (W3's 5.4k tokens in powers of two padded to 8,192 ran as slowly as eager launches).
TOKEN_BUCKETS = (*range(256, 2048, 256), *range(2048, 8192, 512), *range(8192, 32768 + 1, 1024))
# Batches above this run eagerly by default: larger ones keep the GPU busy on their own (``max_tokens`` moves it).
MAX_GRAPH_TOKENS = 8192
# Captured shapes kept; the least recently used goes first. Graphs share one memory pool, so a graph of its own
# costs little more than its input buffers and output: a server's warm-up (``engine.warm_up``) captures up to ~130.
MAX_GRAPHS = 160
# Reads are padded to a power of two of at least this many: a request's item count then moves a call to another
# graph only past 64 items, so a server's mix of request sizes keeps few shapes (a padded read costs one row of the
# last layer's MLP).
MIN_READS = 64
# ... and to at least one read per this many tokens of the bucket: a read costs a row of the last layer's MLP, so
# padding them is cheap, while a server's request mix (more items, more reads) then keeps to one graph per bucket
# and sequence count, the shapes that warm-up captures.
TOKENS_PER_READ = 32
WARMUP_RUNS = 2  # eager runs on a side stream before a capture: compiles and autotunes outside the graph
MIN_KEPT_ROWS = 256  # a kept head's slot rows: a power of two of at least this many (heads of 257-512 share one)


@dataclass(frozen=True)
class GraphKey:
    """The padded shape of a batch, and which forward it runs: one captured graph each."""

    tokens: int
    sequences: int
    reads: int  # 0 for a forward of every token
    causal: bool
    typed: bool
    read: bool  # forward_read (the read rows) or forward (every token)
    long_keys: bool = False  # the attention kernel's long-keys tile (``takes_long_keys_tile``)
    kept: int = 0  # rows of the kept-head slot the sequences may read (0: no kept head)


def graph_key(batch: PackedBatch, read: bool, max_tokens: int = MAX_GRAPH_TOKENS) -> GraphKey | None:
    """The bucket ``batch`` pads to, or None when it is larger than ``max_tokens`` (or than every bucket)."""
    tokens = next((bucket for bucket in TOKEN_BUCKETS if batch.num_tokens <= bucket <= max_tokens), None)
    if tokens is None:
        return None
    sequences = batch.cu_seqlens.numel() - 1 + (tokens > batch.num_tokens)  # + the padding's own sequence
    reads = max(_power_of_two(batch.read_positions.numel()), MIN_READS, _power_of_two(tokens // TOKENS_PER_READ)) \
        if read else 0
    kept = 0 if batch.cached_head is None else max(_power_of_two(batch.cached_len), MIN_KEPT_ROWS)
    return GraphKey(tokens, _power_of_two(sequences), reads, batch.causal, batch.token_type_ids is not None, read,
                    takes_long_keys_tile(batch.causal, batch.keys_per_query), kept)


def _power_of_two(count: int) -> int:
    return 1 << max(count - 1, 0).bit_length()


def empty_batch(key: GraphKey, device: torch.device) -> PackedBatch:
    """Buffers of the key's shapes on ``device`` (what a graph reads from), holding only padding."""
    def zeros(count: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.zeros(count, dtype=dtype, device=device)

    batch = PackedBatch(
        input_ids=zeros(key.tokens), position_ids=zeros(key.tokens), cu_seqlens=zeros(key.sequences + 1, torch.int32),
        max_seqlen=key.tokens, prefix_lens=zeros(key.sequences, torch.int32),
        span_starts=zeros(key.tokens, torch.int32), read_positions=zeros(key.reads),
        causal=key.causal, token_type_ids=zeros(key.tokens) if key.typed else None,
        keys_per_query=float(LONG_KEYS_PER_QUERY) if key.long_keys else 0.0,  # picks the tile the capture bakes in
        cached_head=np.zeros(key.kept, dtype=np.int64) if key.kept else None,
        cached_lens=zeros(key.sequences, torch.int32) if key.kept else None)
    batch.cu_seqlens[1:] = key.tokens
    return batch


def load_padded(target: PackedBatch, batch: PackedBatch) -> None:
    """Write ``batch`` (on any device) into ``target`` (buffers of a larger key) with the padding described above,
    in place."""
    tokens, sequences = batch.num_tokens, batch.cu_seqlens.numel() - 1
    for name in ("input_ids", "position_ids", "token_type_ids", "read_positions", "prefix_lens", "cached_lens"):
        buffer, values = getattr(target, name), getattr(batch, name)
        if buffer is None or buffer.numel() == 0:  # no read buffer: a forward of every token
            continue
        buffer.zero_()
        buffer[:values.numel()].copy_(values, non_blocking=True)
    target.span_starts.fill_(tokens)  # the padding tokens' span is their own sequence, which starts at `tokens`
    target.span_starts[:tokens].copy_(batch.span_starts, non_blocking=True)
    target.cu_seqlens.fill_(target.num_tokens)
    target.cu_seqlens[:sequences + 1].copy_(batch.cu_seqlens, non_blocking=True)


def pad_batch(batch: PackedBatch, key: GraphKey) -> PackedBatch:
    """``batch`` padded to ``key`` as a new batch (the CPU-testable form of what a replay sees)."""
    padded = empty_batch(key, batch.input_ids.device)
    load_padded(padded, batch)
    return padded


class GraphCaptureError(RuntimeError):
    """Capturing a CUDA graph failed (the cause is chained); the caller may run the batch eagerly instead."""


@dataclass
class _Graph:
    inputs: PackedBatch
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor


class GraphedForward:
    """Runs ``forward`` / ``forward_read`` of a packed model through CUDA graphs, one per padded shape.

    ``run`` returns None for a batch of more than ``max_tokens`` tokens, or of a shape with no graph once ``frozen``
    (the caller runs it eagerly), and raises ``GraphCaptureError`` when a capture fails. Graphs capture the model as it is at capture time: switching its
    options afterwards (``fused_qk``...) does not reach them.
    """

    def __init__(self, forward: Callable[[PackedBatch], torch.Tensor],
                 forward_read: Callable[[PackedBatch], torch.Tensor], device: torch.device,
                 max_tokens: int = MAX_GRAPH_TOKENS) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        if max_tokens < TOKEN_BUCKETS[0]:
            raise ValueError(f"max_tokens must be at least {TOKEN_BUCKETS[0]}, not {max_tokens}")
        self.max_tokens = max_tokens
        self._forwards = {False: forward, True: forward_read}
        self._device = device
        self._graphs: OrderedDict[GraphKey, _Graph] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle()
        self._slots: dict[int, tuple[CachedKV, CachedKV | None]] = {}  # rows -> (slot, the head it holds)
        self.captures = 0
        self.frozen = False  # set once warm-up is done: a shape without a graph then runs eagerly, never captured

    def run(self, batch: PackedBatch, read: bool, cached_kv: CachedKV | None = None) -> torch.Tensor | None:
        """The forward's rows for ``batch`` (read rows, or every token), or None when no graph applies. ``batch``
        may lie on the host (pinned, for asynchronous copies) or on the device: it is copied into the graph's own
        buffers either way. ``cached_kv``: the keys and values of ``batch.cached_head``, when it has one."""
        key = graph_key(batch, read, self.max_tokens)
        if key is None:
            return None
        if key.kept and cached_kv is None:
            raise ValueError("a batch with a cached head needs its cached_kv")
        slot = self._load_slot(key.kept, cached_kv) if key.kept else None
        graph = self._graphs.get(key)
        if graph is None and self.frozen:
            return None
        if graph is None:
            graph = self._capture(key, batch, slot)
        else:
            self._graphs.move_to_end(key)
        load_padded(graph.inputs, batch)
        graph.graph.replay()
        rows = batch.read_positions.numel() if read else batch.num_tokens
        return graph.output[:rows].clone()  # the next replay of any graph may reuse the output's memory

    def _load_slot(self, rows: int, cached_kv: CachedKV) -> CachedKV:
        """The slot of ``rows`` rows a layer, holding ``cached_kv`` in its first rows (copied there unless it already
        does; the rows past it are never read)."""
        slot, holds = self._slots.get(rows, (None, None))
        if slot is None:
            def empty(like: torch.Tensor) -> torch.Tensor:
                return torch.zeros((rows, *like.shape[1:]), dtype=like.dtype, device=like.device)

            slot = CachedKV([empty(k) for k in cached_kv.keys], [empty(v) for v in cached_kv.values])
        if holds is not cached_kv:
            for target, source in zip((*slot.keys, *slot.values), (*cached_kv.keys, *cached_kv.values)):
                target[:source.shape[0]].copy_(source)
        self._slots[rows] = (slot, cached_kv)
        return slot

    def _capture(self, key: GraphKey, batch: PackedBatch, slot: CachedKV | None) -> _Graph:
        while len(self._graphs) >= MAX_GRAPHS:
            self._graphs.popitem(last=False)
        inputs = empty_batch(key, self._device)
        load_padded(inputs, batch)
        forward = self._forwards[key.read]
        if slot is not None:
            forward = functools.partial(forward, cached_kv=slot)
        try:
            with torch.cuda.device(self._device):
                output, graph = self._record(forward, inputs)
        except RuntimeError as error:  # out of memory, an operation that cannot be captured...
            raise GraphCaptureError(f"capturing the forward of {key} failed: {error}") from error
        self.captures += 1
        self._graphs[key] = _Graph(inputs, graph, output)
        return self._graphs[key]

    def _record(self, forward: Callable[[PackedBatch], torch.Tensor],
                inputs: PackedBatch) -> tuple[torch.Tensor, torch.cuda.CUDAGraph]:
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                forward(inputs)
        torch.cuda.current_stream(self._device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a planning thread (overlap=True) may pin host memory while this thread captures. The capture
        # runs on ``side``, a stream of this device: torch.cuda.graph's default stream is one for the process, made
        # on the device of the first capture, so a model on cuda:1 captured after one on cuda:0 ran on cuda:0.
        with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
            output = forward(inputs)
        return output, graph
