"""Model runners: turn a ``PackedBatch`` into the final hidden state of every token, ``[T, d]``.

``ReferenceRunner`` runs the transformers model itself on a right-padded batch and drops the padding again: slow,
but it is the reference that faster runners are checked against. A runner is chosen per model by ``make_runner``;
a packed runner (our own forward over ``cu_seqlens``) plugs in there with the same ``forward`` contract.
"""

from __future__ import annotations

from typing import Protocol

import torch

from rerankit.engine.batch import PackedBatch
from rerankit.engine.load import LoadedModel


class Runner(Protocol):
    """Runs the body of a model over packed batches."""

    padded: bool  # True when the runner pays for padding, so the planner budgets longest x count

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Final hidden states ``[batch.num_tokens, d]`` in packed order, on the model's device.

        The planner builds ``batch`` on the CPU; the runner moves what it needs.
        """
        ...


class ReferenceRunner:
    """The transformers base model (the body under the LM / classification head) on right-padded batches."""

    padded = True

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


def make_runner(loaded: LoadedModel) -> Runner:
    """The runner for ``loaded``: today always the reference runner."""
    return ReferenceRunner(loaded)
