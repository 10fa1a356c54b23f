"""Scripts run in a fresh interpreter, as an app runs them: nothing imported yet, no Triton interpreter (the tests'
conftest turns it on without a GPU, and it is not thread-safe), no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import rerankit

CHILD_ENV = {**{name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"},
             "PYTHONPATH": os.pathsep.join([str(Path(rerankit.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
             "CUDA_VISIBLE_DEVICES": ""}


def run_script(code: str, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, killed after ``timeout`` seconds."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout, env={**CHILD_ENV, **env})
