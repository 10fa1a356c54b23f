"""Each adapter imports only its own framework, and neither loads torch before the first query."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import rerankit

# The child must import this checkout's rerankit whether or not it is pip-installed.
CHILD_ENV = {**os.environ, "PYTHONPATH": str(Path(rerankit.__file__).parents[1])}

CHECK = """
import sys
import rerankit.integrations.{module} as adapter
adapter.RerankitRerank(top_n=2)
loaded = sorted(name for name in ("torch", "transformers", "{other}") if name in sys.modules)
assert not loaded, loaded
"""


@pytest.mark.parametrize("module, other", [("langchain", "llama_index"), ("llama_index", "langchain_core")])
def test_adapter_import_and_construction_load_neither_torch_nor_the_other_framework(module, other):
    completed = subprocess.run([sys.executable, "-c", CHECK.format(module=module, other=other)],
                               capture_output=True, text=True, timeout=60, env=CHILD_ENV)

    assert completed.returncode == 0, completed.stderr
