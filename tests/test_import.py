"""Importing rerankit (schema, Reranker, templates) must not import torch: remote-only users have none."""

import os
import subprocess
import sys
from pathlib import Path

import rerankit


def test_import_rerankit_does_not_import_torch():
    code = ("import sys, rerankit, rerankit.templates, rerankit.schema, rerankit.reranker; "
            "print(','.join(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))")
    source_root = str(Path(rerankit.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source_root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert done.stdout.strip() == ""


def test_a_missing_model_folder_fails_before_torch_loads():
    code = ("import sys\nfrom rerankit.errors import ModelLoadError\nfrom rerankit.reranker import make_backend\n"
            "for model in ('./no-such-model', '/no/such/model'):\n"
            "    try:\n        make_backend(model, data_parallel_size=4)\n"
            "    except ModelLoadError as error:\n        print(error)\n"
            "print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    source_root = str(Path(rerankit.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source_root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert done.stdout.splitlines() == ["no model folder at './no-such-model'", "no model folder at '/no/such/model'",
                                        ""]
