"""``EmbeddedBackend``: the Backend protocol over a model in this process.

Requests go encode (template, tokens, checks) -> plan (shared micro-batches under a token budget, the prefix shared
among a request's items where that is exact) -> run (the runner chosen for the model) -> heads (scores at the read
positions), and the results are scattered back to each request in input order. Scores stay on the device until the
whole call has been launched; one copy to the host ends it. Requests are encoded and planned lazily, as the
micro-batches are consumed, so on a GPU the host tokenizes request k+1 while the GPU runs request k's launches;
``overlap=True`` also moves planning to a worker thread (``prefetch``). With a planning thread or CUDA graphs the
first request is encoded in two chunks so that the GPU starts on the first one early (unless its query and
instruction are long next to its first items).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from rerankit.engine import heads
from rerankit.engine.encode import EncodedRequest, encode_request, later_item_ids
from rerankit.engine.resolve import ENCODER_TAKES_NO_TEMPLATE, Defaults, check_instruction_written, resolve_request
from rerankit.engine.load import LoadedModel, load_model
from rerankit.engine.plan import DEFAULT_MAX_BATCH_TOKENS, MicroBatch, Planner, RequestParts, pack
from rerankit.engine.prefetch import prefetch
from rerankit.engine.prefix_cache import PREFIX_CACHE_MAX_BYTES
from rerankit.engine.process_safety import LIVE_BACKENDS, score_cancellably
from rerankit.engine.results import HostCopy, SliceOutput, responses
from rerankit.engine.runner import PackedRunner, Runner, make_runner
from rerankit.engine.warm_up import warm_up_runner
from rerankit.errors import Cancelled, InvalidRequest, ModelLoadError, RerankitError
from rerankit.schema import ScoreRequest, ScoreResponse
from rerankit.templates import Template, get_template

PROGRESS_MIN_ITEMS = 256  # below this a call is quick enough that a progress bar is noise
MAX_CACHED_HEADS = 256  # label sets come from requests: a server keeps the newest heads only
PREFETCH_MICRO_BATCHES = 2  # micro-batches planned ahead of the GPU on the planning thread
# Ramp-up on a GPU: the call's first request is encoded in chunks of RAMP_CHUNKS items, then the rest; each ramp
# chunk runs as a micro-batch of its own when its prefix is at most 1/RAMP_PREFIX_SHARE of its tokens (a long shared
# prefix would be computed again in each for little gain). A request whose query and instruction are that long next
# to its first items (counted in characters, or ids) is encoded in one chunk: one tokenizer call costs ~1 ms more.
RAMP_CHUNKS = (16,)
RAMP_PREFIX_SHARE = 8
WARM_UP_REQUEST_ITEMS = 16  # warm-up's requests in a call of several requests (a server's calls, CUDA graph shapes)


@dataclass
class _Prepared:
    """A checked and encoded request, with the head that scores it."""

    request: ScoreRequest
    encoded: EncodedRequest
    head_key: tuple
    query_tokens: int = 0  # tokens of the query's own forward (bi-encoder, late interaction)
    template: Template | None = None  # the template it was encoded with


class _Call:
    """One ``score_batch`` call: its requests and what planning learns about them, read by the running side.

    entries[i]: request i's encoding (chunks merged as they come), or None while unplanned or when it failed.
    errors[i]:  request i's error (``return_exceptions``), else None.
    head_entries[k]: the first entry scored by head k; the head is built from it when first needed.
    """

    def __init__(self, requests: list[ScoreRequest]) -> None:
        self.requests = requests
        self.entries: list[_Prepared | None] = [None] * len(requests)
        self.errors: list[RerankitError | None] = [None] * len(requests)
        self.head_entries: list[_Prepared] = []


class EmbeddedBackend:
    """Scores requests with a transformers model loaded here, on a GPU (bf16) or the CPU (float32).

    ``mode``, ``template`` (a name or a ``Template``) and ``instruction`` (for templates that take one) set this
    backend's defaults (a request may still give its own);
    ``max_batch_tokens`` bounds the tokens of a micro-batch (padded tokens for the reference runner);
    ``runner``: "auto" runs our packed forward where it supports the model, else the transformers model
    ("reference", padded; it never shares prefixes); ``multi_item`` allows prefix sharing (MIS) for requests that
    ask for it (``ScoreRequest.multi_item``, the default) wherever the runner can, i.e. the packed runner on a
    causal model, on CUDA and on the CPU alike; False turns it off for every request. Requests are always encoded and
    planned as the model runs, one micro-batch ahead of it (the launches are asynchronous on a GPU); ``overlap``
    moves that to a worker thread and starts the model on a call's first 16 items while the rest is tokenized. On
    an H100 it never paid (first W1 1,241 vs 1,678 pairs/s, LI 2,103 vs 2,236; in the latest run W1 and W2 tied and
    LI 2,142 vs 2,296): the thread contends for the GIL with the launches. It stays an option for hosts where
    tokenizing is slow next to the model.
    ``cuda_graphs`` replays the packed forward of micro-batches up to 8,192 tokens from CUDA graphs, one captured
    per padded shape (``engine/graphs.py``), to take the host's per-layer launches out of small calls; None (the
    default) uses them wherever the packed runner runs on CUDA. On an H100, W3 (1 query x 20 docs) p50 went from
    29.3 to 17.8 ms. With graphs a call also ramps up: its first 16 items run as a micro-batch of their own, replayed
    in one launch, while the host tokenizes the rest (W1 59.7 vs 63.1 ms), unless its query and instruction are long
    next to those items (LI: one tokenizer call, 43.4 vs 45.0 ms) or the whole request fits one graph
    (``_ramp_closes``). ``prefix_cache_bytes``: a packed decoder keeps
    each layer's keys and values of long prompt heads (a template's system prompt and instruction of at least 256
    tokens) across calls, up to this many bytes, least recently used dropped first (``engine/prefix_cache.py``); a
    request's micro-batches then leave the head's tokens out (CUDA graphs included); 0 turns it off.
    ``show_progress`` None shows a progress bar for calls of more than 256 items. ``pipelined`` (None: on a GPU)
    tells a server to keep two calls in flight (``pipelined_calls``). Thread-safe: one lock serialises
    use of the model; a call lets go of it once its work is queued on the device, so on a GPU a second thread's
    call plans and launches while the first one's scores are computed and copied back (``pipelined_calls``).
    """

    def __init__(self, model: str, *, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 mode: str | None = None, template: str | Template | None = None, instruction: str | None = None,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, runner: str = "auto",
                 multi_item: bool = True, overlap: bool = False, cuda_graphs: bool | None = None,
                 prefix_cache_bytes: int = PREFIX_CACHE_MAX_BYTES, show_progress: bool | None = None,
                 pipelined: bool | None = None) -> None:
        # Options that do not need the model are checked before it loads, which can take minutes.
        if template is not None:
            check_instruction_written(get_template(template), instruction)
        if max_batch_tokens < 1:
            raise InvalidRequest("max_batch_tokens", f"must be >= 1, got {max_batch_tokens}")
        if prefix_cache_bytes < 0:
            raise InvalidRequest("prefix_cache_bytes", f"must be >= 0, got {prefix_cache_bytes}")
        # the packed runner reads an encoder's tensors straight from its file; the reference runner needs the model
        self._loaded: LoadedModel | None = load_model(model, device=device, dtype=dtype,
                                                      packed_only=runner != "reference")
        loaded = self._loaded
        if mode is not None and mode not in loaded.supported_modes:
            raise ModelLoadError(f"{model!r} cannot score in mode {mode!r}; it supports {loaded.supported_modes}")
        if template is not None and not loaded.is_decoder:
            raise ModelLoadError(f"template: {ENCODER_TAKES_NO_TEMPLATE}")
        self._defaults = Defaults(mode, template, instruction)
        self._classify = heads.sequence_classifier(loaded.model) if loaded.kind == "sequence-classifier" else None
        self._runner: Runner = make_runner(loaded, runner, cuda_graphs, prefix_cache_bytes)
        self._multi_item = multi_item
        self._overlap = bool(overlap)
        self._ramp: bool | None = None  # None: ramp up where it pays (``_ramps``); True/False force it
        self._heads: dict[tuple, heads.Head] = {}
        self.max_batch_tokens = max_batch_tokens
        self.show_progress = show_progress
        self._pipelined = loaded.device.type == "cuda" if pipelined is None else bool(pipelined)
        self._lock = threading.Lock()
        self._tokenizer_thread: ThreadPoolExecutor | None = None  # tokenizes a ramped request's later chunks
        self._tokenize_later_chunks = True  # ahead, on that thread (``_tokenize_ahead``); False: when planned
        LIVE_BACKENDS.add(self)  # made fit for a forked child (``process_safety``)

    @property
    def model_name(self) -> str:
        """The model path or hub id this backend was built with."""
        return self._model().name

    @property
    def max_length(self) -> int:
        """The longest sequence (query, item and template) the model takes; longer pairs are cut to it."""
        return self._model().max_length

    @property
    def pipelined_calls(self) -> int:
        """How many ``score_batch`` calls from different threads keep this backend busy (``pipelined``, by default on
        a GPU): 2, one launching while the other's last kernels run and its scores are copied back; else 1 (on the
        CPU the work is synchronous: a second call would only wait for the first)."""
        return 2 if self._pipelined else 1

    @property
    def runner(self) -> str:
        """"packed" or "reference": the runner this backend uses."""
        return "reference" if self._runner.padded else "packed"

    def score(self, request: ScoreRequest) -> ScoreResponse:
        """Score every item of ``request``; one result per item, in input order."""
        return self.score_batch([request])[0]

    async def ascore(self, request: ScoreRequest) -> ScoreResponse:
        """``score`` on a worker thread, so the event loop keeps running. Cancelling the awaiting task stops the
        call before its next micro-batch (it no longer holds the model for a caller that has gone)."""
        return await score_cancellably(self.score_batch, request)

    def score_batch(self, requests: list[ScoreRequest], *, return_exceptions: bool = False,
                    should_stop: Callable[[], bool] | None = None) -> list[ScoreResponse | RerankitError]:
        """Score several requests in shared micro-batches; one response per request, in order.

        A request that fails its checks (``InvalidRequest``...) raises its ``RerankitError`` and the call returns
        nothing; with ``return_exceptions`` its error takes its place in the list instead and the other requests
        are scored. An error while the model runs (out of memory) is not any one request's fault and raises for
        the whole call. Requests are encoded and planned as the model runs (on a worker thread with ``overlap``),
        so a bad request late in a long call is found once the requests before it have been planned.
        ``should_stop`` is asked before each micro-batch; when it says True the call raises ``Cancelled`` (a server
        stops scoring for callers that have all gone away).
        """
        with self._lock:
            loaded = self._model()
            with torch.inference_mode(), _on_device(loaded.device):
                call = _Call(requests)
                micro_batches = self._plan(call, loaded, return_exceptions)
                if self._overlap:  # plan on a worker thread while this one launches
                    micro_batches = prefetch(micro_batches, PREFETCH_MICRO_BATCHES, name="rerankit-plan")
                try:
                    outputs, computed = self._execute(call, micro_batches, loaded, should_stop)
                finally:  # a failed call stops its planning (and the planning thread) now, not when it is collected
                    micro_batches.close()
                copy = HostCopy(outputs)  # queued before the model is let go: no later call writes what it reads
        # The model is free from here: on a GPU the next call launches while this one's last kernels run and its
        # scores travel to the host (``pipelined_calls``).
        return responses(call.requests, call.entries, call.errors, copy, computed, loaded.name)

    def warm_up(self, shapes: list[tuple[int, int]] | None = None) -> float:
        """Score synthetic calls, for each (items, words per item) of ``shapes`` (default: 1 and 20 items of 80
        words), so that real calls do not pay for what a first call of each size costs; on CUDA a shape of 32 items
        or more also runs as requests of 16 items in one call, a server's usual mix (more sequences, the same tokens).
        Then, on a GPU, run every batch shape that traffic commonly forms (``engine.warm_up``: compiling, tuning,
        capturing the CUDA graphs, which are then frozen), so that no request pays for them. On the CPU, where no
        size costs more the first time, only the default shapes run. Returns the seconds it took. A generative model
        with no known template is warmed up with raw label ids; ``rerankit serve`` calls this, with the shapes its
        scheduler forms, before it answers."""
        begun = time.perf_counter()
        on_gpu = self._model().device.type == "cuda"
        if not shapes or not on_gpu:  # on the CPU nothing is compiled or captured per shape
            shapes = [(1, 80), (20, 80)]
        for count, words in shapes:
            text = " ".join(["warm up"] * (words // 2 or 1))
            splits = [[count]] + ([[WARM_UP_REQUEST_ITEMS] * (count // WARM_UP_REQUEST_ITEMS)]
                                  if on_gpu and count >= 2 * WARM_UP_REQUEST_ITEMS else [])
            for sizes in splits:
                requests = [ScoreRequest(query="warm up", items=[text] * size) for size in sizes]
                try:
                    self._warm_call(requests)
                except InvalidRequest as error:
                    if error.field != "template":
                        raise
                    self._warm_call([request.model_copy(update={"label_token_ids": [0, 1]})  # raw scoring
                                     for request in requests])
        if isinstance(self._runner, PackedRunner) and on_gpu:
            loaded = self._model()
            with self._lock, torch.inference_mode(), _on_device(loaded.device):
                warm_up_runner(self._runner, loaded.max_length, causal=loaded.is_decoder,
                               typed="token_type_ids" in loaded.tokenizer.model_input_names,
                               every_token=not heads.reads_only(self._defaults.mode or loaded.default_mode,
                                                                loaded.pooling))
        return time.perf_counter() - begun

    def _warm_call(self, requests: list[ScoreRequest]) -> None:
        if len(requests) == 1:
            self.score(requests[0])
        else:
            self.score_batch(requests)

    def close(self) -> None:
        """Drop the model; later calls raise ``ModelLoadError``."""
        with self._lock:
            on_gpu = self._loaded is not None and self._loaded.device.type == "cuda"
            self._loaded = None
            self._runner = None  # type: ignore[assignment]
            self._classify = None
            self._heads = {}
            if self._tokenizer_thread is not None:
                self._tokenizer_thread.shutdown()
                self._tokenizer_thread = None
            if on_gpu:
                torch.cuda.empty_cache()

    def _after_fork(self) -> None:
        """In a forked child: the parent's lock (held there by another thread, maybe) and tokenizing thread (not
        copied by fork: its queue would never be served) are the parent's; this process starts its own."""
        self._lock = threading.Lock()
        self._tokenizer_thread = None

    def _model(self) -> LoadedModel:
        if self._loaded is None:
            raise ModelLoadError("this EmbeddedBackend is closed")
        return self._loaded

    def _prepare(self, request: ScoreRequest, loaded: LoadedModel, position: int,
                 items: slice | None = None, earlier: _Prepared | None = None,
                 item_ids: list[list[int]] | None = None) -> _Prepared:
        """Checks and token ids (of ``request.items[items]``), and the key of the head that will score them;
        ``earlier``: the request's entry so far, whose encoding (all but the items) a later chunk reuses;
        ``item_ids``: that chunk's items tokenized ahead (``_tokenize_ahead``)."""
        request, mode, template = resolve_request(request, loaded, self._defaults)
        encoded = encode_request(request, loaded, mode, template, items,
                                 earlier.encoded if earlier is not None else None, item_ids)
        if mode == "generative":
            key: tuple = (mode, tuple(encoded.label_ids), request.apply_softmax, encoded.lone_label_sigmoid)
        elif mode == "cross-encoder":
            key = (mode,)
        else:
            key = (mode, position)  # each request has its own query
        return _Prepared(request, encoded, key, template=template)

    def _shares_prefix(self, request: ScoreRequest, encoded: EncodedRequest) -> bool:
        """MIS where it is exact and pays: a causal packed model, several items after a prefix, read at the end."""
        return (self._multi_item and self._runner.supports_multi_item and request.multi_item
                and len(encoded.item_ids) > 1  # items, or windows of one long document
                and len(encoded.prefix_ids) > 0 and not encoded.read_first
                and encoded.mode in ("generative", "cross-encoder"))

    def _ramps(self) -> bool:
        """Whether a call ramps up (its first request's first items as a micro-batch of their own): where the GPU can
        start on them cheaply, with a planning thread or when the small batch replays from a CUDA graph."""
        if self._ramp is not None:
            return self._ramp
        return self._overlap or self._runner.graphs is not None

    def _chunks(self, request: ScoreRequest, ramp: bool) -> list[slice]:
        """The item chunks a request is encoded in: when the call ramps up, first the ``RAMP_CHUNKS`` (each while
        at least as many items follow it as came before, and while the prefix looks short next to the first chunk's
        items), then the rest; else all at once."""
        count = len(request.items)
        if not ramp or not self._ramp_pays(request):
            return [slice(0, count)]
        bounds = [0]
        for size in RAMP_CHUNKS:
            if count - (bounds[-1] + size) < bounds[-1] + size:
                break
            bounds.append(bounds[-1] + size)
        bounds.append(count)
        return [slice(start, end) for start, end in zip(bounds[:-1], bounds[1:])]

    @staticmethod
    def _ramp_pays(request: ScoreRequest) -> bool:
        """Before tokenizing: whether the query and instruction (characters, or ids) are at most
        1/RAMP_PREFIX_SHARE of the first ramp chunk's items; the planner checks the tokens again. A long instruction
        whose head the runner keeps (``engine.prefix_cache``) still counts: ramping LI up with its head kept tied
        with one launch (H100, ``timeline.py --ab``, 4 rounds: 38.3-39.3 ms against 37.7-38.9)."""
        prefix = len(request.query) + len(request.instruction or "")
        return prefix * RAMP_PREFIX_SHARE <= sum(len(item) for item in request.items[:RAMP_CHUNKS[0]])

    def _ramp_closes(self, parts: RequestParts, chunk: slice, request_items: int) -> bool:
        """Whether a ramp chunk (tokenized) runs as a micro-batch of its own: where its prefix is a small share of
        it, and where the whole request, projected from the chunk's tokens, would not replay from one CUDA graph
        anyway. A request that fits one graph runs as one: split, it pads two graphs and halves each GEMM's rows,
        for ~1 ms of tokenizing overlapped (H100, 32 documents in 7.9k tokens, one micro-batch against the ramp's
        two: 0.6B 18.2 against 19.8 ms, 4B 101.2 against 106.5, 8B 179.1 against 193.7; FP8 alike)."""
        spans = int(parts.span_lengths.sum())
        if parts.share_prefix and len(parts.prefix) * RAMP_PREFIX_SHARE > spans:
            return False
        graphs = self._runner.graphs
        if graphs is None:  # a planning thread (``overlap``) without graphs: the GPU starts as soon as it can
            return True
        scale = request_items / max(1, chunk.stop - chunk.start)  # the chunk's items to the request's
        prefixes = 1 if parts.share_prefix else len(parts.items) * scale
        return spans * scale + len(parts.prefix) * prefixes > graphs.max_tokens

    def _plan(self, call: "_Call", loaded: LoadedModel, return_exceptions: bool) -> Iterator[MicroBatch]:
        """Encode the requests in order and yield their micro-batches as they fill.

        With ``overlap`` or CUDA graphs the call ramps up: the first request's first few items go in a micro-batch of
        their own (when their prefix is a small share of it), so the GPU starts on them while the rest is tokenized.
        """
        planner = Planner(self.max_batch_tokens, padded=self._runner.padded, causal=loaded.is_decoder,
                          pin_memory=self._runner.pin_memory)
        head_ids: dict[tuple, int] = {}
        ramp = self._ramps()
        ahead: dict[int, Future] = {}  # a later chunk's index -> its items' ids, being tokenized on a worker thread
        try:
            for position, request in enumerate(call.requests):
                try:
                    yield from self._plan_request(call, loaded, planner, head_ids, position, request, ramp, ahead)
                except RerankitError as error:
                    if not return_exceptions:
                        raise
                    call.errors[position] = error  # its items already planned are dropped from the results
                ramp = False  # only the call's first request ramps up
            yield from planner.finish()
        finally:  # a failed or stopped call leaves no tokenizing behind it
            for future in ahead.values():
                if not future.cancel():
                    future.exception()

    def _plan_request(self, call: "_Call", loaded: LoadedModel, planner: Planner, head_ids: dict[tuple, int],
                      position: int, request: ScoreRequest, ramp: bool,
                      ahead: dict[int, Future]) -> Iterator[MicroBatch]:
        """Encode one request, chunk by chunk where it ramps up, into ``planner``; yield the micro-batches it fills.
        Once the first chunk is encoded, the later chunks' items are tokenized on a worker thread (``ahead``) while
        this one plans and launches the first: the tokenizer releases the GIL, so the GPU is not left waiting on it
        after the first micro-batch (H100, W1 FP8: 4-9 ms of tokenizing and planning against ~6.5 ms of the
        ramp's GPU time)."""
        chunks = self._chunks(request, ramp)
        for chunk_index, items in enumerate(chunks):
            entry = call.entries[position]
            item_ids = ahead.pop(chunk_index).result() if chunk_index in ahead else None
            chunk = self._prepare(request, loaded, position, items, entry, item_ids)
            if entry is None:
                entry = call.entries[position] = chunk
                if chunk.head_key not in head_ids:
                    head_ids[chunk.head_key] = len(head_ids)
                    call.head_entries.append(chunk)
                self._tokenize_ahead(chunk, loaded, chunks, ahead)
            else:
                entry.encoded.extend(chunk.encoded)
            encoded = chunk.encoded
            share = self._shares_prefix(request, encoded)
            parts = RequestParts.from_encoded(
                encoded, cache_head=share and self._runner.prefix_cache is not None, share_prefix=share,
                head=head_ids[chunk.head_key], own_batches=not heads.reads_only(encoded.mode, loaded.pooling),
                item_offset=len(entry.encoded.item_ids) - len(encoded.item_ids))  # windows count as items
            yield from planner.add(position, parts)
            if chunk_index < len(chunks) - 1 and self._ramp_closes(parts, items, len(request.items)):
                yield from planner.close()  # a ramp chunk: its own micro-batch

    def _tokenize_ahead(self, first: _Prepared, loaded: LoadedModel, chunks: list[slice],
                        ahead: dict[int, Future]) -> None:
        """Submit the items of ``chunks`` after the first (whose encoding is ``first``) to the tokenizing thread."""
        if len(chunks) < 2 or not self._tokenize_later_chunks:
            return
        if self._tokenizer_thread is None:
            self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rerankit-tokenize")
        for index, items in enumerate(chunks[1:], 1):
            ahead[index] = self._tokenizer_thread.submit(later_item_ids, first.request, loaded,
                                                         first.encoded.mode, first.template, items)

    def _execute(self, call: "_Call", micro_batches: Iterator[MicroBatch], loaded: LoadedModel,
                 should_stop: Callable[[], bool] | None = None) -> tuple[list[SliceOutput], list[int]]:
        """Run the model and the heads over each micro-batch as it comes; scores stay on the device. ``should_stop``
        is asked before each micro-batch (``Cancelled`` when it says True)."""
        head_list: dict[int, heads.Head] = {}
        outputs: list[SliceOutput] = []
        computed = [0] * len(call.requests)
        count = sum(len(request.items) for request in call.requests)
        show = self.show_progress if self.show_progress is not None else count > PROGRESS_MIN_ITEMS
        with tqdm(total=count, disable=not show, desc="rerankit", unit="item") as progress:
            for micro in micro_batches:
                if should_stop is not None and should_stop():
                    raise Cancelled("the call was stopped before its last micro-batch: its callers had gone")
                read_states = None
                for key, start, end in micro.head_slices:
                    head = head_list.get(key)
                    if head is None:
                        head = head_list[key] = self._head(call.head_entries[key], loaded)
                    if head.reads_only:
                        if read_states is None:
                            read_states = self._runner.forward_read(micro.batch)
                        out = head.score(read_states[start:end], micro.batch)
                    else:  # the request has this micro-batch to itself (own_batches)
                        out = head.score(self._runner.forward(micro.batch), micro.batch)
                    outputs.append(SliceOutput(micro.read_requests[start:end], micro.read_items[start:end], out,
                                                call.requests))
                for index, tokens in micro.request_tokens.items():
                    computed[index] += tokens
                progress.update(len(micro.read_items))
        for index, entry in enumerate(call.entries):
            if entry is not None:
                computed[index] += entry.query_tokens
        return outputs, computed

    def _head(self, entry: _Prepared, loaded: LoadedModel) -> heads.Head:
        """The head for the request's mode; generative and cross-encoder heads are kept for later calls."""
        encoded = entry.encoded
        if encoded.mode in ("generative", "cross-encoder"):
            if entry.head_key not in self._heads:
                if len(self._heads) >= MAX_CACHED_HEADS:  # a call holds its own references to the heads it uses
                    self._heads.pop(next(iter(self._heads)))
                if encoded.mode == "generative":
                    self._heads[entry.head_key] = heads.generative_head(
                        loaded.model.get_output_embeddings(), encoded.label_ids,
                        apply_softmax=entry.request.apply_softmax, lone_label_sigmoid=encoded.lone_label_sigmoid)
                else:
                    self._heads[entry.head_key] = heads.cross_encoder_head(self._classify)
            return self._heads[entry.head_key]
        query = encoded.query_sequence()
        query_batch = pack([query], causal=loaded.is_decoder)
        query_hidden = self._runner.forward(query_batch)
        entry.query_tokens = query_batch.num_tokens
        if encoded.mode == "bi-encoder":
            embedding = heads.pool(query_hidden, query_batch, loaded.pooling, loaded.normalize_embeddings)[0]
            return heads.bi_encoder_head(embedding, loaded.pooling, loaded.normalize_embeddings)
        return heads.late_interaction_head(query_hidden, loaded.pooling, loaded.normalize_embeddings)


def _on_device(device: torch.device):
    """Make ``device`` the current CUDA device for a call (a no-op elsewhere): Triton launches its kernels and
    torch captures CUDA graphs on the current device, which for a model on ``cuda:1`` is not the default one."""
    if device.type == "cuda" and device.index is not None:  # plain "cuda" is the current device already
        return torch.cuda.device(device)
    return contextlib.nullcontext()
