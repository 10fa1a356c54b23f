"""The ramp-up's split: a call's first items run as a micro-batch of their own only where the whole request would not
replay from one CUDA graph anyway (``EmbeddedBackend._ramp_closes``), planned here on the CPU with a stand-in for
the graphs' token limit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rerankit.engine import EmbeddedBackend
from rerankit.engine.backend import _Call
from rerankit.schema import ScoreRequest
from test_fast_path import make_decoder


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    path = make_decoder(tmp_path_factory.mktemp("ramp") / "qwen3-lm", "lm")
    backend = EmbeddedBackend(str(path), device="cpu", runner="packed")
    backend._ramp = True  # as with CUDA graphs
    return backend


def planned(backend: EmbeddedBackend, request: ScoreRequest, graph_tokens: int | None) -> list[int]:
    """The tokens of each micro-batch the backend plans for ``request`` when its graphs take up to
    ``graph_tokens`` tokens (None: no graphs)."""
    runner = backend._runner
    saved = runner.graphs
    runner.graphs = None if graph_tokens is None else SimpleNamespace(max_tokens=graph_tokens)
    try:
        return [micro.batch.num_tokens for micro in backend._plan(_Call([request]), backend._model(), False)]
    finally:
        runner.graphs = saved


# MIS: the query's 3 ids once, then 40 items of 2 ids (each followed by no suffix): 83 tokens in one micro-batch
SHARED = ScoreRequest(query=[5, 6, 7], items=[[20 + index, 21] for index in range(40)], label_token_ids=[30, 31])


def test_a_request_that_fits_one_graph_runs_as_one_micro_batch(backend):
    assert planned(backend, SHARED, graph_tokens=83) == [83]
    assert planned(backend, SHARED, graph_tokens=4096) == [83]


def test_a_request_larger_than_a_graph_ramps_up(backend):
    # projected from the first 16 items (3 + 16 * 2 tokens): 3 + 80 > 82, so they run apart, the prefix again after
    assert planned(backend, SHARED, graph_tokens=82) == [3 + 16 * 2, 3 + 24 * 2]


def test_without_graphs_a_ramp_chunk_always_runs_apart(backend):  # a planning thread starts the GPU early
    assert planned(backend, SHARED, graph_tokens=None) == [3 + 16 * 2, 3 + 24 * 2]


def test_the_projection_counts_each_pairs_prefix_when_items_do_not_share_it(backend):
    packed = SHARED.model_copy(update={"multi_item": False})  # 40 pairs of 3 + 2 tokens each
    assert planned(backend, packed, graph_tokens=200) == [200]
    assert planned(backend, packed, graph_tokens=199) == [16 * 5, 24 * 5]
