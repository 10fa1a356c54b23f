"""An encoder checkpoint's tensors read straight from ``model.safetensors``, for the packed encoder alone.

The packed encoder only reads weight tensors by their transformers attribute paths (``encoder.layer[i].attention
.self.query.weight``...). Building the transformers model to get them imports its modelling stack (``modeling_bert``
pulls in generation, activations and torch.distributed): about half of a CPU ``rerankit rank`` with the packaged
MiniLM. Here the same tensors come from the file, as a tree of namespaces with those paths.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

WEIGHTS_FILE = "model.safetensors"


def read_encoder_weights(folder: Path, config: Any, device: torch.device, dtype: torch.dtype) -> Any | None:
    """The checkpoint in ``folder`` as a tree of its tensors (floating ones in ``dtype``), with ``config`` and
    ``base_model`` as transformers has them; None when there is no single safetensors file to read."""
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    tensors = load_file(str(path), device=str(device))
    tree: dict[str, Any] = {}
    for name, tensor in tensors.items():
        *parents, leaf = name.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    root = _namespace(tree)
    root.config = config
    # a task checkpoint (BertForX) keeps its body under the model type's prefix ("bert.", "roberta."); a base
    # model's tensors are at the top
    prefix = getattr(config, "model_type", "").replace("-", "_")
    root.base_model = getattr(root, prefix, root) if prefix != "xlm_roberta" else getattr(root, "roberta", root)
    return root


def _namespace(node: dict[str, Any]) -> Any:
    """Nested dicts as namespaces; a node whose keys are all numbers (``layer.0``, ``layer.1``) as a list."""
    children = {key: _namespace(value) if isinstance(value, dict) else value for key, value in node.items()}
    if children and all(key.isdigit() for key in children):
        return [children[key] for key in sorted(children, key=int)]
    return SimpleNamespace(**children)
