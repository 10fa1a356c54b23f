"""Loading a model folder or hub id with transformers, and working out what it can score."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

import torch

from rerankit.engine import fp8
from rerankit.engine.checkpoint import read_encoder_weights
from rerankit.errors import InvalidRequest, ModelLoadError
from rerankit.hub import check_source

ModelKind = Literal["causal-lm", "sequence-classifier", "encoder"]
Pooling = Literal["mean", "cls", "lasttoken"]

# What each kind of checkpoint can score; the first mode is the default.
SUPPORTED_MODES: dict[str, tuple[str, ...]] = {
    "causal-lm": ("generative",),
    "sequence-classifier": ("cross-encoder",),
    "encoder": ("bi-encoder", "late-interaction"),
}
_ST_POOLING_KEYS: dict[str, Pooling] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "lasttoken",
}
# Loads in this process, one at a time: transformers' from_pretrained swaps process-wide state while it builds a
# model (PreTrainedModel.tie_weights patched out, torch's default dtype, torch.linspace) and restores it after, and
# its lazy first import is not thread-safe either; two threads loading at once got ImportError or meta tensors,
# and could leave tie_weights a no-op for the rest of the process (every later tied model failed to load).
_LOADING = threading.RLock()
_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass
class LoadedModel:
    """A transformers model in eval mode with its tokenizer and the facts the engine needs about it."""

    name: str
    model: Any
    tokenizer: Any
    config: Any
    kind: ModelKind
    is_decoder: bool
    pooling: Pooling
    normalize_embeddings: bool
    max_length: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype  # of the activations, and of the weights unless ``fp8``
    fp8: bool = False  # the packed decoder's projections run in FP8 (``engine.fp8``); ``dtype`` is then bfloat16
    fp8_weights: fp8.Fp8Weights | None = None  # an FP8 checkpoint's float8 weights, for the packed decoder to keep

    @property
    def supported_modes(self) -> tuple[str, ...]:
        """The scoring modes this checkpoint can serve."""
        return SUPPORTED_MODES[self.kind]

    @property
    def default_mode(self) -> str:
        """The mode used when neither the request nor the backend names one."""
        return self.supported_modes[0]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The asked device, or CUDA when there is one, else the CPU; ``InvalidRequest`` for one this process lacks."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
        torch.empty(0, device=chosen)  # torch's own check, so "cuda:3" on a 1-GPU host fails here, not mid-load
    except (RuntimeError, AssertionError, TypeError) as exc:
        raise InvalidRequest("device", f"{device!r} cannot be used in this process: {exc}") from None
    return chosen


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The asked dtype, or bfloat16 on a GPU and float32 on the CPU; bfloat16 for "fp8" (the activations' dtype)."""
    if fp8.is_fp8(dtype):
        return torch.bfloat16
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPE_NAMES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPE_NAMES)}, fp8") from None


def load_model(model: str, *, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None, weights: bool = True,
               packed_only: bool = False) -> LoadedModel:
    """Load a model folder (offline) or a hub id; ``ModelLoadError`` for a missing path or an unsupported model.

    A hub id is read from the local cache when it is there (no network call); one that is not fails at once when
    the hub cannot be reached. ``weights=False`` loads the config and tokenizer only (``model`` is None): enough
    to encode requests (``rerankit render``). ``packed_only``: the caller runs the packed encoder only, so an
    encoder folder the packed encoder runs is read as plain tensors (``engine.checkpoint``), not built as a
    transformers model. ``dtype="fp8"``: FP8 projections (``engine.fp8``), on GPUs with FP8 tensor cores only; a
    checkpoint stored in FP8 runs so by default where the device can, else dequantized to the default dtype.
    """
    with _LOADING:  # one load at a time in this process (see _LOADING)
        return _load_model(model, device=device, dtype=dtype, weights=weights, packed_only=packed_only)


def _load_model(model: str, *, device: str | torch.device | None, dtype: str | torch.dtype | None,
                weights: bool, packed_only: bool) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer

    folder = Path(model).expanduser()
    local = folder.exists()
    offline = local or check_source(model)
    source = str(folder) if local else model
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=offline)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the config of {model!r}: {exc}") from exc
    kind = _model_kind(config, folder if local else None)
    if kind == "causal-lm" and getattr(config, "final_logit_softcapping", None) is not None:
        raise ModelLoadError(f"{model!r} soft-caps its logits, which the label-logprob head does not support")
    torch_device = resolve_device(device)
    stored_fp8 = fp8.checkpoint_format(config)
    run_fp8 = fp8.is_fp8(dtype) or (dtype is None and stored_fp8 is not None and weights
                                     and (fp8.device_lacks_fp8(torch_device) is None or fp8.reference_mode()))
    if run_fp8 and weights:
        fp8.check_device(torch_device)
    torch_dtype = resolve_dtype("fp8" if run_fp8 else dtype, torch_device)
    if stored_fp8 is not None:  # transformers builds the plain model; its float8 weights are read here
        config = fp8.without_quantization(config)
    network = None
    if weights and packed_only and local and kind == "encoder" and stored_fp8 is None:
        from rerankit.engine.models import unsupported_reason  # make_runner's decision: it will run packed

        if unsupported_reason(config, torch_device) is None:
            network = read_encoder_weights(folder, config, torch_device, torch_dtype)
    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=offline)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {model!r}: {exc}") from exc
    if weights and network is None:
        network = _transformers_model(model, source, kind, torch_device, torch_dtype, offline,
                                      config if stored_fp8 else None)
    fp8_weights = None
    if weights and stored_fp8 is not None:
        fp8_weights = fp8.read_fp8_weights(folder if local else _snapshot(model), torch_device)
        fp8.load_dequantized(network, fp8_weights)
    pooling, normalize = _sentence_transformers_pooling(folder) if local else (None, False)
    decoder = _is_decoder(config)
    if network is None:
        rows = [getattr(config, "vocab_size", None) or len(tokenizer)]
    elif isinstance(network, torch.nn.Module):
        rows = [network.get_input_embeddings().num_embeddings]
        if kind == "causal-lm":
            rows.append(network.get_output_embeddings().weight.shape[0])
    else:
        rows = [network.base_model.embeddings.word_embeddings.weight.shape[0]]
    return LoadedModel(
        name=model, model=network, tokenizer=tokenizer, config=config, kind=kind, is_decoder=decoder,
        pooling=pooling or ("lasttoken" if decoder else "mean"), normalize_embeddings=normalize,
        max_length=_max_length(config, tokenizer, folder if local else None), vocab_size=min(rows),
        device=torch_device, dtype=torch_dtype, fp8=run_fp8, fp8_weights=fp8_weights if run_fp8 else None,
    )


def _auto_class(kind: ModelKind) -> Any:
    """The transformers Auto class of a checkpoint kind (imported here: it pulls in the modelling stack)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    return {"causal-lm": AutoModelForCausalLM, "sequence-classifier": AutoModelForSequenceClassification,
            "encoder": AutoModel}[kind]


def is_transformers_model(loaded: LoadedModel) -> bool:
    """False where ``loaded.model`` is the tensors ``packed_only`` read from an encoder's file."""
    return isinstance(loaded.model, torch.nn.Module)


def load_transformers_model(loaded: LoadedModel) -> None:
    """Build the transformers model of ``loaded`` (read with ``packed_only``) in place of its raw tensors, for a
    runner that needs it after all."""
    if loaded.model is not None and not is_transformers_model(loaded):
        source = str(Path(loaded.name).expanduser())  # packed_only reads local folders only
        with _LOADING:
            loaded.model = _transformers_model(loaded.name, source, loaded.kind, loaded.device, loaded.dtype,
                                               True)


def _transformers_model(model: str, source: str, kind: ModelKind, device: torch.device, dtype: torch.dtype,
                        offline: bool, config: Any = None) -> Any:
    """The transformers model (``config``: instead of the folder's own, e.g. without its quantization)."""
    extra = {} if config is None else {"config": config}
    try:
        with _quiet_transformers():
            network = _auto_class(kind).from_pretrained(source, dtype=dtype, local_files_only=offline, **extra)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {model!r}: {exc}") from exc
    return network.to(device).eval()


def _snapshot(model: str) -> Path:
    """The local folder of a hub checkpoint that transformers has just loaded (so it is in the cache)."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, local_files_only=True))


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide transformers' per-load weight progress bar (it clutters CLI output), restoring the user's setting."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _model_kind(config: Any, folder: Path | None) -> ModelKind:
    architectures = list(getattr(config, "architectures", None) or [])
    if any(name.endswith("ForCausalLM") for name in architectures):
        return "causal-lm"
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        return "sequence-classifier"
    is_sentence_transformer = folder is not None and (folder / "modules.json").is_file()
    if is_sentence_transformer or any(name.endswith("Model") for name in architectures):
        return "encoder"
    raise ModelLoadError(
        f"architecture {architectures or 'unknown'} is not supported: rerankit scores *ForCausalLM (generative), "
        "*ForSequenceClassification (cross-encoder) and base encoder / sentence-transformers models (bi-encoder)"
    )


def _is_decoder(config: Any) -> bool:
    """Causal attention: a family with a causal LM head and no masked LM head."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, \
        MODEL_FOR_MASKED_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", "")
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def _sentence_transformers_pooling(folder: Path) -> tuple[Pooling | None, bool]:
    """Pooling mode from the sentence-transformers Pooling module, and whether a Normalize module follows."""
    modules_file = folder / "modules.json"
    modules = json.loads(modules_file.read_text()) if modules_file.is_file() else []
    pooling_dirs = [entry["path"] for entry in modules if entry.get("type", "").endswith("Pooling")] or ["1_Pooling"]
    normalize = any(entry.get("type", "").endswith("Normalize") for entry in modules)
    pooling_file = folder / pooling_dirs[0] / "config.json"
    if not pooling_file.is_file():
        return None, normalize
    settings = json.loads(pooling_file.read_text())
    chosen = [mode for key, mode in _ST_POOLING_KEYS.items() if settings.get(key)]
    unsupported = [key for key, on in settings.items() if key.startswith("pooling_mode") and on
                   and key not in _ST_POOLING_KEYS]
    if unsupported or len(chosen) != 1:
        raise ModelLoadError(f"{pooling_file}: pooling {unsupported or chosen} is not supported; "
                             "rerankit pools by mean, cls or lasttoken")
    return chosen[0], normalize


def _max_length(config: Any, tokenizer: Any, folder: Path | None) -> int:
    """The longest sequence the model takes: position table, sentence-transformers and tokenizer limits."""
    limits = []
    positions = getattr(config, "max_position_embeddings", None)
    if positions:
        # RoBERTa-style position ids start after the padding index, which costs two rows of the table.
        limits.append(positions - 2 if "roberta" in getattr(config, "model_type", "") else positions)
    if folder is not None and (folder / "sentence_bert_config.json").is_file():
        limits.append(json.loads((folder / "sentence_bert_config.json").read_text()).get("max_seq_length") or 0)
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if tokenizer_limit and tokenizer_limit < 1_000_000:  # tokenizers without a limit report a huge sentinel
        limits.append(tokenizer_limit)
    limits = [limit for limit in limits if limit > 0]
    return min(limits) if limits else 512
