"""Warm-up covers the graph shapes a server's traffic forms, so that no capture happens on a request's path."""

from __future__ import annotations

import random

import pytest

from rerankit.engine.backend import EmbeddedBackend, _Call
from rerankit.engine.graphs import MAX_GRAPH_TOKENS, MAX_GRAPHS, graph_key
from rerankit.engine.warm_up import eager_batches, graph_batches, warm_up_runner
from rerankit.schema import ScoreRequest

WORDS = "the capital of France is Paris and the river Seine runs through it while gravity attracts bodies".split()


@pytest.mark.parametrize("causal, max_length", [(True, 40960), (False, 512)])
def test_warm_up_batches_have_distinct_keys_that_all_fit_the_graph_cache(causal: bool, max_length: int) -> None:
    batches = list(graph_batches(MAX_GRAPH_TOKENS, max_length, causal=causal, typed=not causal))
    keys = [graph_key(batch, read=True) for batch in batches]
    assert None not in keys and len(set(keys)) == len(keys) <= MAX_GRAPHS
    for batch in (*batches, *eager_batches(max_length, causal=causal, typed=False)):
        lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
        assert max(lengths) <= max_length and batch.read_positions.numel() == len(lengths)


def test_a_servers_micro_batches_replay_graphs_that_warm_up_captured(tiny_qwen3_lm) -> None:
    """Calls of 1-24 requests of 10 documents (the batcher merges them) plan micro-batches whose graph keys are
    all among warm-up's."""
    backend = EmbeddedBackend(str(tiny_qwen3_lm), device="cpu")
    loaded = backend._model()
    warm = {graph_key(batch, read=True) for batch in graph_batches(MAX_GRAPH_TOKENS, loaded.max_length,
                                                                 causal=True, typed=False)}
    rng = random.Random(0)
    seen = 0
    for count in (1, 2, 3, 4, 5, 6, 8, 11, 16, 24):
        requests = [ScoreRequest(query=" ".join(rng.choices(WORDS, k=8)), label_token_ids=[1, 2],
                                 items=[" ".join(rng.choices(WORDS, k=rng.randint(10, 120))) for _ in range(10)])
                    for _ in range(count)]
        for micro in backend._plan(_Call(requests), loaded, return_exceptions=False):
            key = graph_key(micro.batch, read=True)
            if key is not None:
                seen += 1
                assert key in warm, f"{count} requests planned {key}, which warm-up does not capture"
    assert seen >= 5


class _RecordingRunner:
    """Stands in for a packed runner: records the batches it runs; its graphs freeze when warm-up ends."""

    class _Graphs:
        max_tokens = 1024
        captures = 0
        frozen = False

    def __init__(self) -> None:
        self.graphs = self._Graphs()
        self.read: list[int] = []
        self.full: list[int] = []

    def forward_read(self, batch):
        self.read.append(batch.num_tokens)

    def forward(self, batch):
        self.full.append(batch.num_tokens)


def test_warm_up_runs_every_shape_then_freezes_the_graphs() -> None:
    runner = _RecordingRunner()
    report = warm_up_runner(runner, 512, causal=False, typed=True, every_token=True)
    assert runner.graphs.frozen and runner.read == runner.full and report["batches"] == len(runner.read)
    assert min(runner.read) < 1024 < max(runner.read)  # graph sizes and eager ones
    assert runner.graphs is not None  # put back after the eager sizes ran without it


class _OnCuda:
    """A loaded model that says it is on CUDA, so that ``warm_up`` takes its GPU path (the runner is stubbed)."""

    def __init__(self, loaded) -> None:
        self._loaded = loaded

    def __getattr__(self, name: str):
        return getattr(self._loaded, name)

    @property
    def device(self):
        import torch

        return torch.device("cuda")

    @property
    def default_mode(self) -> str:
        return "cross-encoder"  # reads one row a sequence: no head that pools every token


def test_warm_up_asks_for_every_token_rows_by_the_backends_own_default_mode(monkeypatch) -> None:
    from rerankit.defaults import default_model_path
    from rerankit.engine import backend as backend_module

    backend = EmbeddedBackend(default_model_path(), device="cpu", mode="bi-encoder", show_progress=False)
    assert backend.runner == "packed"
    calls: list[dict] = []
    monkeypatch.setattr(backend, "_model", lambda: _OnCuda(backend._loaded))
    monkeypatch.setattr(backend, "_warm_call", lambda requests: None)
    monkeypatch.setattr(backend_module, "warm_up_runner", lambda runner, max_length, **flags: calls.append(flags))
    backend.warm_up()
    assert calls and calls[0]["every_token"]  # the backend's mean-pooled bi-encoder, not the model's default
    backend.close()
