"""``rerankit serve``'s flags from the environment (``RERANKIT_<FLAG>``): taken as the flags would be, the command
line over them, a bad value one error line naming the variable, and no effect on other commands."""

from __future__ import annotations

import os

import pytest

from rerankit import cli
from rerankit.flags_from_env import PREFIX, variable_of


@pytest.fixture
def served(monkeypatch):
    given: dict = {}
    monkeypatch.setattr(cli, "serve", lambda model, **options: given.update(options, model=model))
    for name in [name for name in os.environ if name.startswith(PREFIX)]:
        monkeypatch.delenv(name)
    return given


def test_every_serve_flag_is_read_from_its_variable_below_the_command_line(served, monkeypatch):
    for name, value in {"RERANKIT_MODEL": "some/model", "RERANKIT_PORT": "9001", "RERANKIT_HOST": "0.0.0.0",
                        "RERANKIT_MAX_BATCH_ITEMS": "64", "RERANKIT_BATCH_WINDOW_MS": "2.5",
                        "RERANKIT_NO_WARMUP": "true", "RERANKIT_NO_BATCHING": "0", "RERANKIT_LOG_FORMAT": "json",
                        "RERANKIT_CALLER_HEADER": "X-Tenant-Id", "RERANKIT_HEADER_TIMEOUT": "3",
                        "RERANKIT_OTLP_TRACES_ENDPOINT": "http://collector:4318",
                        "RERANKIT_PREFIX_CACHE_MIB": "256"}.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["serve"]) == 0
    assert served["model"] == "some/model"
    assert {key: served[key] for key in ("port", "host", "max_batch_items", "batch_window_ms", "warm_up",
                                         "batching", "log_format", "caller_header", "header_timeout_s",
                                         "otlp_traces_endpoint", "prefix_cache_bytes")} == {
        "port": 9001, "host": "0.0.0.0", "max_batch_items": 64, "batch_window_ms": 2.5, "warm_up": False,
        "batching": True, "log_format": "json", "caller_header": "X-Tenant-Id", "header_timeout_s": 3.0,
        "otlp_traces_endpoint": "http://collector:4318", "prefix_cache_bytes": 256 << 20}
    assert cli.main(["serve", "--port", "9002", "--model", "other/model"]) == 0
    assert (served["port"], served["model"], served["max_batch_items"]) == (9002, "other/model", 64)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("RERANKIT_PORT", "eighty", "$RERANKIT_PORT='eighty': "),
    ("RERANKIT_MAX_BATCH_ITEMS", "0", "$RERANKIT_MAX_BATCH_ITEMS='0': "),
    ("RERANKIT_LOG_FORMAT", "xml", "$RERANKIT_LOG_FORMAT='xml': choose from text, json"),
    ("RERANKIT_NO_WARMUP", "maybe", "$RERANKIT_NO_WARMUP='maybe': give one of 1, true"),
])
def test_a_bad_value_is_one_error_line_naming_the_variable_and_other_commands_run(served, monkeypatch, capsys, name,
                                                                                  value, message):
    monkeypatch.setenv(name, value)
    assert cli.main(["serve"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {message}")
    assert served == {}
    assert cli.main(["templates"]) == 0  # a stray variable breaks only the command it belongs to


def test_every_flag_but_the_repeatable_key_and_help_has_a_variable():
    serve = next(action for action in cli.build_parser()._subparsers._actions
                 if action.dest == "command").choices["serve"]
    names = {variable_of(action) for action in serve._actions}
    assert {"RERANKIT_MODEL", "RERANKIT_OTLP_SERVICE_NAME", "RERANKIT_SSL_CERTFILE", "RERANKIT_NO_BATCHING",
            "RERANKIT_DATA_PARALLEL_SIZE", "RERANKIT_TEMPLATE"} <= names
    assert "RERANKIT_API_KEY" not in names and "RERANKIT_HELP" not in names


ENGINE_PLACEMENT = {"RERANKIT_DEVICE": "cuda", "RERANKIT_DTYPE": "bfloat16", "RERANKIT_PREFIX_CACHE_MIB": "64",
                    "RERANKIT_DATA_PARALLEL_SIZE": "2", "RERANKIT_REPLICA_TIMEOUT": "30"}


@pytest.mark.parametrize("model_from", ["command line", "environment"])
def test_where_the_engine_runs_set_in_the_environment_is_ignored_for_a_server_url(served, monkeypatch, capsys,
                                                                                   model_from):
    """An image may set them for every server it starts; a proxy has no engine of its own."""
    for name, value in ENGINE_PLACEMENT.items():
        monkeypatch.setenv(name, value)
    model = ["--model", "http://far:8000"]
    if model_from == "environment":
        monkeypatch.setenv("RERANKIT_MODEL", model.pop())
        model.pop()
    assert cli.main(["serve", *model]) == 0, capsys.readouterr().err
    assert served["model"] == "http://far:8000"
    assert [served[key] for key in ("device", "dtype", "prefix_cache_bytes", "data_parallel_size")] == [None] * 4
    assert "replica_timeout_s" not in served["engine_options"]
    assert cli.main(["serve", "--model", "http://far:8000", "--dtype", "float16"]) == 2  # given: still refused
    assert capsys.readouterr().err == "error: --dtype: only applies to a local model as --model\n"


def test_a_prompt_default_set_in_the_environment_for_a_server_url_is_refused_by_its_variable(served, monkeypatch,
                                                                                            capsys):
    """It would change the scores, which a proxy cannot do; the error names what the user set."""
    monkeypatch.setenv("RERANKIT_INSTRUCTION", "Judge relevance")
    assert cli.main(["serve", "--model", "http://far:8000"]) == 2
    assert capsys.readouterr().err == "error: $RERANKIT_INSTRUCTION: only applies to a local model as --model\n"
    assert served == {}


def test_a_replica_timeout_set_in_the_environment_applies_only_to_replicas(served, monkeypatch, capsys):
    monkeypatch.setenv("RERANKIT_REPLICA_TIMEOUT", "30")
    monkeypatch.setenv("RERANKIT_STARTUP_TIMEOUT", "1800")
    assert cli.main(["serve"]) == 0, capsys.readouterr().err  # one engine in process: nothing to time out
    assert "replica_timeout_s" not in served["engine_options"] and "startup_timeout_s" not in served["engine_options"]
    assert cli.main(["serve", "--data-parallel-size", "2"]) == 0
    assert served["engine_options"]["replica_timeout_s"] == 30.0
    assert served["engine_options"]["startup_timeout_s"] == 1800.0
    monkeypatch.delenv("RERANKIT_REPLICA_TIMEOUT")
    monkeypatch.delenv("RERANKIT_STARTUP_TIMEOUT")
    assert cli.main(["serve", "--replica-timeout", "30"]) == 2  # given: still refused
    assert "error: --replica-timeout: applies to engine replicas" in capsys.readouterr().err


def test_a_variable_that_is_ignored_is_ignored_whatever_its_value(served, monkeypatch, capsys):
    """A value the flag would refuse does not end a server the flag does not apply to."""
    monkeypatch.setenv("RERANKIT_DATA_PARALLEL_SIZE", "all")
    monkeypatch.setenv("RERANKIT_PREFIX_CACHE_MIB", "-1")
    assert cli.main(["serve", "--model", "http://far:8000"]) == 0, capsys.readouterr().err
    assert (served["data_parallel_size"], served["prefix_cache_bytes"]) == (None, None)
    monkeypatch.delenv("RERANKIT_DATA_PARALLEL_SIZE")
    monkeypatch.delenv("RERANKIT_PREFIX_CACHE_MIB")
    monkeypatch.setenv("RERANKIT_REPLICA_TIMEOUT", "-1")
    assert cli.main(["serve"]) == 0, capsys.readouterr().err  # no replicas: nothing to time out
    assert "replica_timeout_s" not in served["engine_options"]
    assert cli.main(["serve", "--data-parallel-size", "2"]) == 2  # replicas: the value counts
    assert capsys.readouterr().err.startswith("error: $RERANKIT_REPLICA_TIMEOUT='-1': ")


@pytest.mark.parametrize(("variables", "flags", "message"), [
    ({"RERANKIT_SSL_KEYFILE": "key.pem"}, [],
     "$RERANKIT_SSL_KEYFILE needs --ssl-certfile (the certificate the server presents)"),
    ({}, ["--ssl-keyfile", "key.pem"], "--ssl-keyfile needs --ssl-certfile (the certificate the server presents)"),
    ({"RERANKIT_SSL_KEYFILE_PASSWORD": "secret"}, ["--ssl-ca-certs", "ca.pem"],
     "$RERANKIT_SSL_KEYFILE_PASSWORD, --ssl-ca-certs need --ssl-certfile"),
    ({"RERANKIT_SSL_CERTFILE": "missing.pem"}, [], "$RERANKIT_SSL_CERTFILE: cannot load the certificate and its key"),
    ({"RERANKIT_OTLP_SERVICE_NAME": "ranker"}, [],
     "$RERANKIT_OTLP_SERVICE_NAME names the spans that --otlp-traces-endpoint sends; give both"),
    ({"RERANKIT_OTLP_TRACES_ENDPOINT": "collector"}, [],
     "$RERANKIT_OTLP_TRACES_ENDPOINT 'collector': give the collector's URL"),
])
def test_a_start_up_error_names_the_variable_that_set_the_flag(monkeypatch, tmp_path, capsys, variables, flags,
                                                                message):
    """The server's own checks (before any model loads) name a flag as the user set it: its variable where the
    environment gave it, the flag where the command line did."""
    for name in [name for name in os.environ if name.startswith(PREFIX)]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["serve", *flags]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {message}") and error.count("\n") == 1, error
