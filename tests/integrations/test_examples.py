"""The runnable examples work offline on the CPU, as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import rerankit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# The child must import this checkout's rerankit whether or not it is pip-installed, and never reach a hub.
CHILD_ENV = {**os.environ, "PYTHONPATH": str(Path(rerankit.__file__).parents[1]), "CUDA_VISIBLE_DEVICES": "",
             "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_example(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / script), "--query", "Which river flows through Paris?",
                           "--top-n", "2"], capture_output=True, text=True, timeout=120, env=CHILD_ENV)


@pytest.fixture(scope="module")
def example_runs(request):
    """{script: the future of its run} for the scripts of the selected tests below, all started together: each
    spends ~3 s importing its framework and torch and loading the model, side by side (2 cores)."""
    scripts = {item.callspec.params["script"] for item in request.session.items
               if getattr(item, "function", None) is test_example_ranks_the_answer_first}
    with ThreadPoolExecutor(max(len(scripts), 1)) as pool:
        yield {script: pool.submit(run_example, script) for script in sorted(scripts)}


@pytest.mark.parametrize("script, first_hit", [
    ("langchain_retrieval.py", "1. ["),
    ("llamaindex_pipeline.py", "  1. ["),
])
def test_example_ranks_the_answer_first(script, first_hit, example_runs):
    completed = example_runs[script].result()

    assert completed.returncode == 0, completed.stderr
    hits = [line for line in completed.stdout.splitlines() if line.lstrip()[:1].isdigit()]
    assert hits and hits[0].startswith(first_hit) and hits[0].endswith("The Seine flows through Paris before "
                                                                       "reaching the English Channel at Le Havre.")
    assert len(hits) == (2 if script.startswith("langchain") else 4)
