"""A call's results: its scores copied to the host, then scattered back to each request and item in input order.

The copy is started while the call still holds the model (``HostCopy``: one device-side concatenation and an
asynchronous copy into pinned memory, marked by an event) and waited for after it has let go, so that on a GPU the
next call launches its micro-batches while this one's last kernels run and its scores travel. Nothing the copy
reads is written by a later call: the concatenation is queued before the model is released, on the same stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rerankit.engine import heads
from rerankit.errors import RerankitError
from rerankit.schema import ScoreRequest, ScoreResponse, ScoreResult, Usage

EXTRAS = (("label_logprobs", "return_label_logprobs"), ("pooled", "return_pooled_hidden_states"))


class SliceOutput:
    """What one head produced for a run of reads: their requests and items (host) and the scores (device).

    Label log-probs and read states are dropped at once unless one of the requests asked for them, so the device
    memory they hold goes back while the call runs on.
    """

    def __init__(self, requests: np.ndarray, items: np.ndarray, scores: heads.BatchScores,
                 call_requests: list[ScoreRequest]) -> None:
        owners = [call_requests[index] for index in np.unique(requests).tolist()]
        if not any(request.return_label_logprobs for request in owners):
            scores.label_logprobs = None
        if not any(request.return_pooled_hidden_states for request in owners):
            scores.pooled = None
        if not any(request.raw_scores for request in owners):
            scores.raw = None
        self.requests, self.items, self.scores = requests, items, scores


class HostCopy:
    """The scores (and asked-for extras) of a call's slice outputs, on their way to the host.

    Built while the call holds the model: every device-side step is queued then. ``wait()`` (any thread, after the
    model is released) blocks until the copy has landed and gives the scores; ``extras`` then holds, per extra,
    (first read, host tensor) for each output that kept one.
    """

    def __init__(self, outputs: Sequence[SliceOutput]) -> None:
        empty = np.zeros(0, dtype=np.int64)
        self.requests = np.concatenate([output.requests for output in outputs]) if outputs else empty
        self.items = np.concatenate([output.items for output in outputs]) if outputs else empty
        scores = torch.cat([output.scores.scores.float() for output in outputs]) if outputs else torch.zeros(0)
        # Raw scores beside them where a request asked (a head without an activation gives its scores)
        raw = torch.cat([(output.scores.raw if output.scores.raw is not None else output.scores.scores).float()
                         for output in outputs]) if any(output.scores.raw is not None for output in outputs) else None
        kept: list[tuple[str, int, torch.Tensor]] = []  # (extra, first read, values), in the outputs' order
        start = 0
        for output in outputs:
            for name, _ in EXTRAS:
                values = getattr(output.scores, name)
                if values is not None:
                    kept.append((name, start, values.float()))
            start += len(output.requests)
        tensors = [scores] + ([] if raw is None else [raw]) + [values for _, _, values in kept]
        self._event: torch.cuda.Event | None = None
        self._device: list[torch.Tensor] | None = None
        if scores.is_cuda:  # queue the copies now; into pinned memory they run while the host moves on
            host = [torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True) for tensor in tensors]
            for target, source in zip(host, tensors):
                target.copy_(source, non_blocking=True)
            self._device = tensors  # kept alive until the copies have landed
            self._event = torch.cuda.Event()
            self._event.record()
            tensors = host
        self._scores = tensors[0]
        self._raw = None if raw is None else tensors[1]
        self.extras: dict[str, list[tuple[int, torch.Tensor]]] = {name: [] for name, _ in EXTRAS}
        for (name, first, _), values in zip(kept, tensors[1 + (raw is not None):]):
            self.extras[name].append((first, values))

    def wait(self) -> np.ndarray:
        """The scores as a float array (one per read, in the outputs' order), once the copy has landed."""
        if self._event is not None:
            self._event.synchronize()
            self._event = self._device = None
        return self._scores.numpy()

    def raw(self) -> np.ndarray | None:
        """The raw scores beside ``wait()``'s (after it), where a request asked for them; None where none did."""
        return None if self._raw is None else self._raw.numpy()


def responses(call_requests: list[ScoreRequest], entries: list, errors: list[RerankitError | None],
              copy: HostCopy, computed: list[int], model_name: str) -> list[ScoreResponse | RerankitError]:
    """Scatter a call's copied outputs back to its requests and items (``entries[i]``: request i's prepared entry,
    or None where ``errors[i]`` says why it failed)."""
    scores = copy.wait()
    raw = copy.raw()
    requests, items = copy.requests, copy.items
    failed = np.array([error is not None for error in errors], dtype=bool)
    tables = {}
    for name, wanted in EXTRAS:
        table: list[list] = [[None] * len(request.items) for request in call_requests]
        for first, values in copy.extras[name]:
            rows = slice(first, first + len(values))
            for value, index, item in zip(values.tolist(), requests[rows].tolist(), items[rows].tolist()):
                if getattr(call_requests[index], wanted) and not failed[index]:
                    table[index][item] = value
        tables[name] = table
    order = np.lexsort((items, requests))
    bounds = np.searchsorted(requests[order], np.arange(len(entries) + 1))
    answers: list[ScoreResponse | RerankitError] = []
    for index, entry in enumerate(entries):
        error = errors[index]
        if error is not None or entry is None:
            answers.append(error)
            continue
        rows = order[bounds[index]:bounds[index + 1]]
        if not np.array_equal(items[rows], np.arange(len(entry.encoded.item_ids))):
            raise RuntimeError(f"the plan scored request {index}'s items {items[rows].tolist()}, not each once")
        windows = entry.encoded.item_windows
        chosen = raw if entry.request.raw_scores and raw is not None else scores
        values = aggregate(chosen[rows], windows, entry.request.long_documents).tolist()
        results = [ScoreResult(index=item, score=values[item], label_logprobs=tables["label_logprobs"][index][item],
                               pooled_hidden_state=tables["pooled"][index][item], windows=windows[item])
                   for item in range(len(values))]
        usage = Usage(prompt_tokens=entry.encoded.prompt_tokens, computed_tokens=computed[index])
        answers.append(ScoreResponse(results=results, model=model_name, usage=usage))
    return answers


def aggregate(scores: np.ndarray, windows: list[int], how: str) -> np.ndarray:
    """One score per item from its windows' consecutive scores: their max, or their mean (``long_documents``)."""
    if len(windows) == len(scores):
        return scores
    starts = np.concatenate(([0], np.cumsum(windows)[:-1]))
    if how == "max":
        return np.maximum.reduceat(scores, starts)
    return np.add.reduceat(scores, starts) / np.asarray(windows)
