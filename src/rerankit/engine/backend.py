"""``EmbeddedBackend``: the Backend protocol over a model in this process.

A request goes encode (template, tokens, checks) -> plan (length-sorted micro-batches) -> run (the runner chosen
for the model) -> heads (scores at the read positions), and the per-batch results are scattered back to input order.
"""

from __future__ import annotations

import asyncio
import threading
import torch
from tqdm.auto import tqdm

from rerankit.engine import heads
from rerankit.engine.encode import EncodedRequest, encode_request, resolve_template
from rerankit.engine.load import LoadedModel, load_model
from rerankit.engine.plan import DEFAULT_MAX_BATCH_TOKENS, pack, plan_batches
from rerankit.engine.runner import Runner, make_runner
from rerankit.errors import InvalidRequest, ModelLoadError
from rerankit.schema import ScoreRequest, ScoreResponse, ScoreResult, Usage
from rerankit.templates import get_template

PROGRESS_MIN_ITEMS = 256  # below this a call is quick enough that a progress bar is noise


class EmbeddedBackend:
    """Scores requests with a transformers model loaded here, on a GPU (bf16) or the CPU (float32).

    ``mode`` and ``template`` set this backend's defaults (a request may still name its own);
    ``max_batch_tokens`` bounds the padded tokens of a micro-batch; ``show_progress`` None shows a progress bar
    for calls of more than 256 items. Thread-safe: one lock serialises use of the model.
    """

    def __init__(self, model: str, *, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 mode: str | None = None, template: str | None = None,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, show_progress: bool | None = None) -> None:
        self._loaded: LoadedModel | None = load_model(model, device=device, dtype=dtype)
        loaded = self._loaded
        if mode is not None and mode not in loaded.supported_modes:
            raise ModelLoadError(f"{model!r} cannot score in mode {mode!r}; it supports {loaded.supported_modes}")
        if template is not None:
            get_template(template)
        if max_batch_tokens < 1:
            raise InvalidRequest("max_batch_tokens", f"must be >= 1, got {max_batch_tokens}")
        self._mode = mode
        self._template = template
        self._classify = heads.sequence_classifier(loaded.model) if loaded.kind == "sequence-classifier" else None
        self._runner: Runner = make_runner(loaded)
        self.max_batch_tokens = max_batch_tokens
        self.show_progress = show_progress
        self._lock = threading.Lock()

    @property
    def model_name(self) -> str:
        """The model path or hub id this backend was built with."""
        return self._model().name

    def score(self, request: ScoreRequest) -> ScoreResponse:
        """Score every item of ``request``; one result per item, in input order."""
        with self._lock, torch.inference_mode():
            return self._score(request, self._model())

    async def ascore(self, request: ScoreRequest) -> ScoreResponse:
        """``score`` on a worker thread, so the event loop keeps running."""
        return await asyncio.to_thread(self.score, request)

    def close(self) -> None:
        """Drop the model; later calls raise ``ModelLoadError``."""
        with self._lock:
            on_gpu = self._loaded is not None and self._loaded.device.type == "cuda"
            self._loaded = None
            self._runner = None  # type: ignore[assignment]
            self._classify = None
            if on_gpu:
                torch.cuda.empty_cache()

    def _model(self) -> LoadedModel:
        if self._loaded is None:
            raise ModelLoadError("this EmbeddedBackend is closed")
        return self._loaded

    def _score(self, request: ScoreRequest, loaded: LoadedModel) -> ScoreResponse:
        mode = request.mode or self._mode or loaded.default_mode
        if mode not in loaded.supported_modes:
            raise InvalidRequest("mode", f"{loaded.name!r} cannot score in mode {mode!r}; "
                                 f"it supports {', '.join(loaded.supported_modes)}")
        template = resolve_template(request, loaded, self._template, mode)
        encoded = encode_request(request, loaded, mode, template)
        head, computed_tokens = self._head(request, encoded, loaded)
        count = len(encoded.item_ids)
        scores: list[float] = [0.0] * count
        label_logprobs: list[list[float] | None] = [None] * count
        pooled: list[list[float] | None] = [None] * count
        batches = plan_batches(encoded.sequences(), self.max_batch_tokens, padded=self._runner.padded,
                               causal=loaded.is_decoder)
        show = self.show_progress if self.show_progress is not None else count > PROGRESS_MIN_ITEMS
        with tqdm(total=count, disable=not show, desc="rerankit", unit="item") as progress:
            for batch in batches:
                out = head(self._runner.forward(batch), batch)
                keys = batch.item_indices.tolist()
                for key, value in zip(keys, out.scores.float().cpu().tolist()):
                    scores[key] = value
                if request.return_label_logprobs and out.label_logprobs is not None:
                    for key, values in zip(keys, out.label_logprobs.float().cpu().tolist()):
                        label_logprobs[key] = values
                if request.return_pooled_hidden_states and out.pooled is not None:
                    for key, values in zip(keys, out.pooled.float().cpu().tolist()):
                        pooled[key] = values
                computed_tokens += batch.num_tokens
                progress.update(len(keys))
        results = [ScoreResult(index=index, score=scores[index], label_logprobs=label_logprobs[index],
                               pooled_hidden_state=pooled[index]) for index in range(count)]
        usage = Usage(prompt_tokens=encoded.prompt_tokens, computed_tokens=computed_tokens)
        return ScoreResponse(results=results, model=loaded.name, usage=usage)

    def _head(self, request: ScoreRequest, encoded: EncodedRequest, loaded: LoadedModel) -> tuple[heads.Head, int]:
        """The head for the request's mode, and the tokens spent before the items (the query, encoded once)."""
        if encoded.mode == "generative":
            return heads.generative_head(loaded.model.get_output_embeddings(), encoded.label_ids,
                                         apply_softmax=request.apply_softmax,
                                         lone_label_sigmoid=encoded.lone_label_sigmoid), 0
        if encoded.mode == "cross-encoder":
            return heads.cross_encoder_head(self._classify), 0
        query = encoded.query_sequence()
        query_batch = pack([query], causal=loaded.is_decoder)
        query_hidden = self._runner.forward(query_batch)
        if encoded.mode == "bi-encoder":
            embedding = heads.pool(query_hidden, query_batch, loaded.pooling, loaded.normalize_embeddings)[0]
            head: heads.Head = heads.bi_encoder_head(embedding, loaded.pooling, loaded.normalize_embeddings)
        else:
            head = heads.late_interaction_head(query_hidden, loaded.pooling, loaded.normalize_embeddings)
        return head, query_batch.num_tokens
