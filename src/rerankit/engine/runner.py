"""Model runners: turn a ``PackedBatch`` into final hidden states, of every token or of the read positions only.

``PackedRunner`` runs our own padding-free forward (``engine.models``) over the packed batch, MIS included.
``ReferenceRunner`` runs the transformers model itself on a right-padded batch and drops the padding again: slow,
but it is the reference that the packed runner is checked against, and the fallback for other architectures.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Protocol

import numpy as np
import torch

from rerankit.engine.batch import PackedBatch
from rerankit.engine.encode import Sequence
from rerankit.engine.graphs import MAX_GRAPH_TOKENS, GraphCaptureError, GraphedForward
from rerankit.engine.load import LoadedModel, is_transformers_model, load_transformers_model
from rerankit.engine.models import PackedDecoder, PackedEncoder, build_packed_model
from rerankit.engine.models import unsupported_reason as packed_reason
from rerankit.engine.plan import pack
from rerankit.engine.prefix_cache import PREFIX_CACHE_MAX_BYTES, CachedKV, PrefixCache
from rerankit.errors import InvalidRequest, ModelLoadError

RUNNERS = ("auto", "packed", "reference")

log = logging.getLogger("rerankit.engine")


class Runner(Protocol):
    """Runs the body of a model over packed batches built on the host."""

    padded: bool  # True when the runner pays for padding, so the planner budgets longest x count
    supports_multi_item: bool  # True when batches may share a prefix among item spans (MIS)
    pin_memory: bool  # True when the planner should build batches in page-locked memory
    graphs: GraphedForward | None  # CUDA graphs that replay small batches, where the runner has them
    prefix_cache: PrefixCache | None  # keys and values of long prompt heads kept across calls, where it can

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Final hidden states ``[batch.num_tokens, d]`` in packed order, on the model's device."""
        ...

    def forward_read(self, batch: PackedBatch) -> torch.Tensor:
        """Final hidden states ``[N, d]`` at ``batch.read_positions``, in that order, on the model's device."""
        ...


class PackedRunner:
    """Our packed forward over the loaded model's weights; one launch sequence per micro-batch, no host syncs."""

    padded = False

    def __init__(self, loaded: LoadedModel, model: PackedDecoder | PackedEncoder, cuda_graphs: bool = False,
                 prefix_cache_bytes: int = PREFIX_CACHE_MAX_BYTES) -> None:
        self.model = model
        self.device = loaded.device
        self.supports_multi_item = loaded.is_decoder
        self.pin_memory = loaded.device.type == "cuda"
        self.graphs = graphed_forward(model, loaded.device) if cuda_graphs else None
        # Kept heads need our attention backends (the model's default): decoders built with another attention_fn
        # (tests, benchmarks) compute every head.
        keeps = isinstance(model, PackedDecoder) and model._attention_fn is None and prefix_cache_bytes > 0
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if keeps else None

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Every token's final state (pooling heads)."""
        return self._run(batch, read=False)

    def forward_read(self, batch: PackedBatch) -> torch.Tensor:
        """The final states at the read positions; the last layer runs on those rows only."""
        return self._run(batch, read=True)

    def _run(self, batch: PackedBatch, read: bool) -> torch.Tensor:
        cached_kv = None
        if batch.cached_head is not None:
            if self.prefix_cache is None:
                raise ValueError("this runner keeps no prefix heads; plan without cached_head")
            cached_kv = self.prefix_cache.get(batch.cached_head, self._keep_prefix)
        # A replay copies the (pinned) host tensors straight into its graph's buffers; only eager runs move them.
        if self.graphs is not None:
            try:
                replayed = self.graphs.run(batch, read, cached_kv)
            except GraphCaptureError as error:
                log.warning("%s; rerankit runs this model without CUDA graphs from now on", error)
                self.graphs = None
                replayed = None
            if replayed is not None:
                return replayed
        batch = self._on_device(batch)
        run = self.model.forward_read if read else self.model.forward
        return run(batch, cached_kv=cached_kv)

    def _keep_prefix(self, head_ids: np.ndarray) -> CachedKV:
        """The model's keys and values of a prompt head, run alone as one sequence."""
        head = Sequence(0, head_ids.tolist(), None, len(head_ids) - 1)
        return self.model.keep_prefix(self._on_device(pack([head], causal=True)))

    def _on_device(self, batch: PackedBatch) -> PackedBatch:
        # The tensors the model reads (the planner pinned them, so the copies are queued without waiting); which
        # request and item each read belongs to stays on the host, in the MicroBatch.
        if batch.input_ids.device == self.device:
            return batch
        moved = {name: getattr(batch, name).to(self.device, non_blocking=True)
                 for name in ("input_ids", "position_ids", "cu_seqlens", "prefix_lens", "span_starts",
                              "read_positions")}
        for name in ("token_type_ids", "cached_lens"):
            if getattr(batch, name) is not None:
                moved[name] = getattr(batch, name).to(self.device, non_blocking=True)
        return dataclasses.replace(batch, **moved)


def graphed_forward(model: PackedDecoder | PackedEncoder, device: torch.device,
                    max_tokens: int = MAX_GRAPH_TOKENS) -> GraphedForward:
    """CUDA graphs over ``model``'s forwards, captured with ``graphed=True`` (the steps that take least GPU time),
    for micro-batches of at most ``max_tokens`` tokens."""
    return GraphedForward(functools.partial(model.forward, graphed=True),
                          functools.partial(model.forward_read, graphed=True), device, max_tokens)


class ReferenceRunner:
    """The transformers base model (the body under the LM / classification head) on right-padded batches."""

    padded = True
    supports_multi_item = False
    pin_memory = False
    graphs = None
    prefix_cache = None

    def __init__(self, loaded: LoadedModel) -> None:
        self.body = loaded.model.base_model
        self.device = loaded.device
        self.is_decoder = loaded.is_decoder
        pad = loaded.config.pad_token_id if loaded.config.pad_token_id is not None else loaded.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else 0

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Pad, run the body, and gather the real tokens back end to end."""
        if batch.is_multi_item:
            raise ValueError("the reference runner scores one item per sequence; plan it without prefix sharing")
        lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).to(torch.int64)
        keep = torch.arange(batch.max_seqlen)[None, :] < lengths[:, None]
        input_ids = torch.full(keep.shape, self.pad_token_id, dtype=torch.int64)
        input_ids[keep] = batch.input_ids.cpu()
        inputs = {"input_ids": input_ids.to(self.device), "attention_mask": keep.to(self.device, torch.int64)}
        if batch.token_type_ids is not None:
            token_types = torch.zeros(keep.shape, dtype=torch.int64)
            token_types[keep] = batch.token_type_ids.cpu()
            inputs["token_type_ids"] = token_types.to(self.device)
        if self.is_decoder:
            inputs["use_cache"] = False
        hidden = self.body(**inputs).last_hidden_state
        return hidden[keep.to(self.device)]

    def forward_read(self, batch: PackedBatch) -> torch.Tensor:
        """The padded forward, then the rows at the read positions."""
        return self.forward(batch)[batch.read_positions.to(self.device)]


def make_runner(loaded: LoadedModel, runner: str = "auto", cuda_graphs: bool | None = None,
                prefix_cache_bytes: int = PREFIX_CACHE_MAX_BYTES) -> Runner:
    """The runner for ``loaded``: "packed" (our forward), "reference" (transformers, padded), or "auto": packed
    when ``engine.models`` runs this architecture, else the reference. ``cuda_graphs`` replays the packed forward
    of small micro-batches from CUDA graphs (``engine.graphs``); True needs the packed runner on a CUDA device,
    None (the default) uses them wherever the packed runner runs on CUDA. ``prefix_cache_bytes`` bounds the keys
    and values of long prompt heads that a packed decoder keeps across calls (``engine.prefix_cache``; 0: none)."""
    if runner not in RUNNERS:
        raise InvalidRequest("runner", f"must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if loaded.fp8:
        _check_fp8(loaded, runner)
    if cuda_graphs and loaded.device.type != "cuda":
        raise InvalidRequest("cuda_graphs", f"CUDA graphs need a CUDA device; this model is on {loaded.device}")
    if runner == "reference":
        if cuda_graphs:
            raise InvalidRequest("cuda_graphs", "CUDA graphs replay the packed runner, not the reference runner")
        load_transformers_model(loaded)
        return ReferenceRunner(loaded)
    reason = packed_reason(loaded.config, loaded.device)  # what load_model decided by
    if reason is None:
        graphs = loaded.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        return PackedRunner(loaded, _packed_model(loaded), graphs, prefix_cache_bytes)
    if runner == "packed" or cuda_graphs:
        fix = "cuda_graphs=False" if cuda_graphs else "runner='auto' or 'reference'"
        raise ModelLoadError(f"{reason}; use {fix}")
    load_transformers_model(loaded)
    return ReferenceRunner(loaded)


def _check_fp8(loaded: LoadedModel, runner: str) -> None:
    """``ModelLoadError`` unless the packed decoder or encoder can run ``loaded`` in FP8."""
    from rerankit.engine.models import decoder, encoder

    if runner == "reference":
        raise ModelLoadError("dtype 'fp8' runs on the packed runner; the reference runner (transformers) runs "
                             "bfloat16 or float32")
    model_reason = (decoder if loaded.is_decoder else encoder).unsupported_reason(loaded.config)
    reason = model_reason or packed_reason(loaded.config, loaded.device)
    if reason is not None:
        raise ModelLoadError(f"dtype 'fp8' runs the packed decoders ({', '.join(decoder.MODEL_TYPES)}) and encoders "
                             f"({', '.join(encoder.MODEL_TYPES)}) only, and {loaded.name!r} cannot run on one: "
                             f"{reason}; use dtype 'bfloat16'")


def _packed_model(loaded: LoadedModel) -> PackedDecoder | PackedEncoder:
    """The packed model over ``loaded``'s weights; where it was read as raw tensors (``packed_only``) and they do
    not build one (a checkpoint that names its tensors otherwise), over the transformers model instead. An FP8
    decoder keeps the checkpoint's float8 weights (``loaded.fp8_weights``), which ``loaded`` then lets go of."""
    if loaded.fp8:
        fp8_weights, loaded.fp8_weights = loaded.fp8_weights, None
        return build_packed_model(loaded.model, fp8=True, fp8_weights=fp8_weights)
    if is_transformers_model(loaded):
        return build_packed_model(loaded.model)
    try:
        return build_packed_model(loaded.model)
    except Exception as exc:  # noqa: BLE001 - any failure of the raw tensors: transformers reads the checkpoint
        log.warning("the packed encoder could not be built from %s's tensors (%s: %s); loading the transformers "
                    "model", loaded.name, type(exc).__name__, exc)
    load_transformers_model(loaded)
    return build_packed_model(loaded.model)
