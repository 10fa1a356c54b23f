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
