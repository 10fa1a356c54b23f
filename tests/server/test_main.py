"""``serve()`` as ``rerankit serve`` runs it: a subprocess on the tiny cross-encoder, key from the environment."""

from __future__ import annotations

import logging.config
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from live_server import wait_until_healthy

SRC = str(Path(__file__).resolve().parents[2] / "src")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_serve_scores_logs_its_steps_draws_no_progress_bar_and_takes_the_api_key_from_the_environment(
        tiny_bert_cross_encoder):
    port = free_port()
    code = (f"from rerankit.server.main import serve; serve({str(tiny_bert_cross_encoder)!r}, port={port}, "
            "device='cpu', max_batch_items=512, batch_window_ms=None)")
    env = {**os.environ, "PYTHONPATH": SRC, "RERANKIT_API_KEY": "from-env", "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(server, url)
        body = {"query": "capital of France", "documents": ["Paris", "a dog"]}
        assert httpx.post(url + "/rerank", json=body, timeout=30).status_code == 401
        reply = httpx.post(url + "/rerank", json=body, headers={"Authorization": "Bearer from-env"}, timeout=30)
        assert reply.status_code == 200, reply.text
        assert sorted(result["index"] for result in reply.json()["results"]) == [0, 1]
        many = {"query": "capital of France", "documents": [f"d{number}" for number in range(300)]}
        reply = httpx.post(url + "/rerank", json=many, headers={"Authorization": "Bearer from-env"}, timeout=60)
        assert reply.status_code == 200, reply.text
    finally:
        server.terminate()
        _, log = server.communicate(timeout=30)
    lines = [line.split(maxsplit=1)[-1] for line in log.splitlines()]
    assert f"loading {Path(tiny_bert_cross_encoder).name}..." in lines
    assert any(line.startswith("warming up") for line in lines), log
    assert f"ready on {url}" in lines
    assert "item/s" not in log, log  # tqdm's bar: "rerankit: 100%|...| 300/300 [00:01<00:00, 270 item/s]"


def test_serve_freezes_the_collector_shows_no_progress_and_hands_connection_settings_to_uvicorn(monkeypatch):
    from types import SimpleNamespace

    import rerankit.reranker
    import rerankit.server.app
    import rerankit.server.shutdown
    from rerankit.server.main import serve

    configs, engine_options, servers, handshakes = [], [], [], []

    class Closing:
        def close(self):
            pass

    class Server:
        started = True

        def __init__(self, uvicorn_config, batcher, drain_seconds, handshake_timeout_s):
            servers.append(uvicorn_config)
            handshakes.append(handshake_timeout_s)

        def run(self, sockets):
            assert sockets[0].getsockname()[1] != 0  # bound before the model loaded

    def make_backend(model, **options):
        engine_options.append(options)
        return Closing()

    def create_app(backend, config):
        configs.append(config)
        return SimpleNamespace(state=SimpleNamespace(batcher=None))

    monkeypatch.setattr(rerankit.reranker, "make_backend", make_backend)
    monkeypatch.setattr(rerankit.server.app, "create_app", create_app)
    monkeypatch.setattr(rerankit.server.shutdown, "DrainingServer", Server)
    monkeypatch.setattr(logging.config, "dictConfig", lambda config: None)  # leaves the session's loggers alone
    serve("some-model", port=0)
    serve("some-model", port=0, freeze_gc=False, keep_alive_timeout_s=2.5, header_timeout_s=3, max_connections=7)
    assert [config.freeze_gc for config in configs] == [True, False]
    assert [options["show_progress"] for options in engine_options] == [False, False]
    assert servers[1].timeout_keep_alive == 2.5
    assert (servers[1].http.max_connections, servers[1].http.header_timeout_s) == (7, 3)
    assert handshakes[1] == 3  # a TLS handshake is bounded as a request's headers are


def test_listen_names_a_port_in_use_and_a_host_that_does_not_resolve():
    from rerankit.errors import RerankitError
    from rerankit.server.main import listen

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RerankitError, match=f"^port {port} on 127.0.0.1 is in use$"):
            listen("127.0.0.1", port)
    with pytest.raises(RerankitError, match="host 'no-such-host.invalid'"):
        listen("no-such-host.invalid", 0)


def test_serve_hands_the_connection_flags_to_the_server(monkeypatch):
    from rerankit import cli

    given = {}
    monkeypatch.setattr(cli, "serve", lambda model, **options: given.update(options))
    assert cli.main(["serve", "--max-connections", "7", "--header-timeout", "3", "--timeout-keep-alive", "0",
                     "--body-timeout", "12.5"]) == 0
    assert (given["max_connections"], given["header_timeout_s"], given["keep_alive_timeout_s"]) == (7, 3, 0)
    assert given["body_timeout_s"] == 12.5
    assert cli.main(["serve"]) == 0 and given["max_connections"] is None and given["header_timeout_s"] is None
    assert given["body_timeout_s"] is None
    with pytest.raises(SystemExit):
        cli.main(["serve", "--body-timeout", "-1"])
    with pytest.raises(SystemExit):
        cli.main(["serve", "--header-timeout", "0"])


@pytest.mark.parametrize("api_key", ["", " ", ["good-key", ""]])
def test_serve_refuses_an_empty_api_key_before_loading_anything(monkeypatch, api_key):
    """An empty key (an unset ``$KEY`` passed on) is refused, not taken for "no key": that would open the server."""
    from rerankit.errors import RerankitError
    from rerankit.server.main import serve

    monkeypatch.setenv("RERANKIT_API_KEY", "from-the-environment")
    with pytest.raises(RerankitError, match="api_key: a key is empty"):
        serve("/no/such/model", api_key=api_key)


def test_serve_refuses_a_blank_api_key_variable(monkeypatch):
    """``$RERANKIT_API_KEY`` set but empty (a secret that did not arrive) is refused; unset, it means no key."""
    from rerankit.errors import RerankitError
    from rerankit.server.main import serve

    monkeypatch.setenv("RERANKIT_API_KEY", " ")
    with pytest.raises(RerankitError, match=r"\$RERANKIT_API_KEY is set but empty"):
        serve("/no/such/model")
