"""Shared test set-up: the `gpu` marker skips where no CUDA device is present."""

from __future__ import annotations

import importlib.util
import os

import pytest


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


# Without a GPU, Triton kernels run in its interpreter on CPU tensors; it must be chosen before triton loads.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The interpreter without its repeated per-helper-call set-up (a no-op off the interpreter or on another triton).
from interpreter_speedup import install as _install_interpreter_speedup  # noqa: E402

_install_interpreter_speedup()

# httpx clients share the default SSL context instead of loading the CA bundle each (see httpx_speedup.py).
from httpx_speedup import install as _install_httpx_speedup  # noqa: E402

_install_httpx_speedup()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_qwen3_lm(tmp_path_factory: pytest.TempPathFactory):
    """Path of a tiny random Qwen3ForCausalLM (with tokenizer) saved on disk."""
    from tiny_models import make_qwen3_causal_lm

    return make_qwen3_causal_lm(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_qwen3_classifier(tmp_path_factory: pytest.TempPathFactory):
    """Path of a tiny random Qwen3ForSequenceClassification (one logit)."""
    from tiny_models import make_qwen3_sequence_classifier

    return make_qwen3_sequence_classifier(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_bert_cross_encoder(tmp_path_factory: pytest.TempPathFactory):
    """Path of a tiny random BertForSequenceClassification (one logit)."""
    from tiny_models import make_bert_cross_encoder

    return make_bert_cross_encoder(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_bert_embedder(tmp_path_factory: pytest.TempPathFactory):
    """Path of a tiny random BERT embedding model with mean pooling."""
    from tiny_models import make_bert_embedder

    return make_bert_embedder(tmp_path_factory.mktemp("models"))


# The embedded backends over the tiny models, shared by the server and proxy tests (started once a session).
@pytest.fixture(scope="session")
def lm(tiny_qwen3_lm):
    from rerankit.engine import EmbeddedBackend

    backend = EmbeddedBackend(str(tiny_qwen3_lm))
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def ce(tiny_bert_cross_encoder):
    from rerankit.engine import EmbeddedBackend

    backend = EmbeddedBackend(str(tiny_bert_cross_encoder))
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def label_ids(tiny_qwen3_lm):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3_lm).convert_tokens_to_ids(["yes", "no"])
