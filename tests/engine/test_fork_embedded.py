"""A process forked after a model was loaded (gunicorn --preload, multiprocessing's 'fork', Celery's prefork)
scores like its parent, and does not hang. Each scenario runs in a fresh interpreter."""

from __future__ import annotations

import pytest

from fresh_python import run_script

FORKED = """
    import os, sys, time, signal
    from rerankit import Reranker, ScoreRequest
    model = None if sys.argv[1] == "default" else sys.argv[1]
    reranker = Reranker(model, overlap=sys.argv[2] == "overlap")
    request = ScoreRequest(query="capital of France", items=[f"Paris is the capital of France {i}" * (1 + i % 7)
                                                              for i in range(48)])
    want = [r.score for r in reranker.score(request).results]
    pid = os.fork()
    if pid == 0:
        got = [r.score for r in reranker.score(request).results]
        same = max(abs(a - b) for a, b in zip(got, want)) < 1e-5  # 1 thread here: sums in another order
        print("child", same, flush=True)
        os._exit(0 if same else 3)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            sys.exit(os.waitstatus_to_exitcode(status))
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    print("child hung", flush=True)
    sys.exit(4)
"""


@pytest.mark.parametrize("model, overlap", [("default", ""), ("tiny", "overlap")])
def test_a_child_forked_after_the_model_ran_scores_like_the_parent(model, overlap, tiny_qwen3_lm):
    # gunicorn --preload, multiprocessing's 'fork': the child hung for good, in torch's OpenMP pool (two threads
    # in the parent), or on the parent's tokenizing thread (overlap), which does not exist in the child.
    done = run_script(FORKED, "default" if model == "default" else str(tiny_qwen3_lm), overlap, timeout=180,
                      OMP_NUM_THREADS="2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    if model == "default":  # it said why it scores on one thread there
        assert "was forked" in done.stderr and "--preload" in done.stderr
