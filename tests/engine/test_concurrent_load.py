"""Models loaded by several threads at once (two adapters' first calls, a Reranker per thread), each in a fresh
interpreter: a failed race could leave transformers broken for the rest of the process."""

from __future__ import annotations

from fresh_python import run_script


CONCURRENT_LOADS = """
    import sys, threading
    from rerankit import Reranker
    errors = []
    def build(model):
        try:
            Reranker(model).rank("q", ["a", "b"])
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    for round_ in range(3):  # the first round also races transformers' first import
        threads = [threading.Thread(target=build, args=(model,)) for model in (sys.argv[1], None) * 2]
        [thread.start() for thread in threads]
        [thread.join() for thread in threads]
    Reranker(sys.argv[1]).rank("q", ["a", "b"])  # a later load still works
    from transformers import PreTrainedModel
    assert PreTrainedModel.tie_weights.__qualname__ == "PreTrainedModel.tie_weights", PreTrainedModel.tie_weights
    print("errors:", errors)
    sys.exit(1 if errors else 0)
"""


def test_models_loaded_by_several_threads_at_once_all_load(tiny_qwen3_lm):
    # Two adapters' first calls, or a Reranker per thread: before, ImportError (transformers' lazy import) and
    # "Cannot copy out of meta tensor", and tie_weights left patched out for the rest of the process.
    done = run_script(CONCURRENT_LOADS, str(tiny_qwen3_lm))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
