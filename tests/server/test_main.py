"""``serve()`` as ``rerankit serve`` runs it: a subprocess on the tiny cross-encoder, key from the environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SRC = str(Path(__file__).resolve().parents[2] / "src")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_serve_scores_with_the_model_and_takes_the_api_key_from_the_environment(tiny_bert_cross_encoder):
    port = free_port()
    code = (f"from rerankit.server.main import serve; serve({str(tiny_bert_cross_encoder)!r}, port={port}, "
            "device='cpu', log_level='warning', max_batch_items=64, batch_window_ms=None)")
    env = {**os.environ, "PYTHONPATH": SRC, "RERANKIT_API_KEY": "from-env", "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-c", code], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, f"serve() exited with status {server.returncode}"
            assert time.monotonic() < deadline, "serve() did not answer /health within 60 s"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"query": "capital of France", "documents": ["Paris", "a dog"]}
        assert httpx.post(url + "/rerank", json=body, timeout=30).status_code == 401
        reply = httpx.post(url + "/rerank", json=body, headers={"Authorization": "Bearer from-env"}, timeout=30)
        assert reply.status_code == 200, reply.text
        assert sorted(result["index"] for result in reply.json()["results"]) == [0, 1]
    finally:
        server.terminate()
        server.wait(30)


def test_serve_freezes_the_collector_after_warm_up_unless_told_not_to(monkeypatch):
    from types import SimpleNamespace

    import rerankit.reranker
    import rerankit.server.app
    import rerankit.server.shutdown
    from rerankit.server.main import serve

    configs = []

    class Closing:
        def close(self):
            pass

    class NotRun:
        started = True

        def __init__(self, config, batcher, drain_seconds):
            pass

        def run(self):
            pass

    def create_app(backend, config):
        configs.append(config)
        return SimpleNamespace(state=SimpleNamespace(batcher=None))

    monkeypatch.setattr(rerankit.reranker, "make_backend", lambda model, **options: Closing())
    monkeypatch.setattr(rerankit.server.app, "create_app", create_app)
    monkeypatch.setattr(rerankit.server.shutdown, "DrainingServer", NotRun)
    serve("some-model")
    serve("some-model", freeze_gc=False)
    assert [config.freeze_gc for config in configs] == [True, False]
