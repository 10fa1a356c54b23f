"""The ``rerankit`` command line, run as a subprocess the way a user runs it."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import rerankit
from rerankit.cli import print_table, ranking_json, read_documents
from rerankit.errors import InvalidRequest
from rerankit.schema import ScoreResponse, ScoreResult, Usage

# The child must import this checkout's rerankit whether or not it is pip-installed.
CHILD_ENV = {**{name: value for name, value in os.environ.items() if name != "RERANKIT_API_KEY"},
             "PYTHONPATH": str(Path(rerankit.__file__).parents[1]), "CUDA_VISIBLE_DEVICES": "",
             "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Bananas are an excellent source of potassium.",
    "Paris is the capital and most populous city of France.",
    "A car engine converts the chemical energy of fuel into motion.",
    "Berlin is the capital of Germany.",
]


def rerankit_cli(*args: str, stdin: str | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rerankit", *args], input=stdin, capture_output=True, text=True,
                          timeout=120, env={**CHILD_ENV, **env})


def _uses(request: pytest.FixtureRequest, fixture: str) -> bool:
    """Whether a test of this module that the session runs uses ``fixture``."""
    return any(getattr(item, "module", None) is request.module and fixture in item.fixturenames
               for item in request.session.items)


def _start_minilm_server() -> tuple[subprocess.Popen, int]:
    """``rerankit serve`` on the packaged MiniLM with an API key, on a free loopback port: (process, port)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "rerankit", "serve", "--port", str(port), "--api-key", "s3cret",
                               "--api-key", "rotated",
                               "--served-model-name", "minilm", "--log-level", "warning"],
                              env=CHILD_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return server, port


def _rank_json_on_stdin() -> subprocess.CompletedProcess:
    return rerankit_cli("rank", "--query", QUERY, "--docs", "-", "--json", stdin="\n".join(DOCUMENTS))


@pytest.fixture(scope="module", autouse=True)
def started_early(request: pytest.FixtureRequest):
    """The module's two slow children, started as it begins where a selected test needs them: ``rerankit rank
    --json`` (for ``local_ranking``) and ``rerankit serve`` (for ``served_minilm``) each spend ~2.5 s importing
    torch and loading the model, which they then do side by side with the subprocess tests before them (2 cores)
    rather than when those fixtures set up. Yields {fixture: its future result or its (process, port)}."""
    started: dict = {}
    with ThreadPoolExecutor(1) as pool:
        if _uses(request, "local_ranking"):
            started["local_ranking"] = pool.submit(_rank_json_on_stdin)
        if _uses(request, "served_minilm"):
            started["served_minilm"] = _start_minilm_server()
        yield started
        server = started.get("served_minilm")
        if server is not None and server[0].poll() is None:  # served_minilm never set up: stop it here
            server[0].kill()
            server[0].wait(timeout=30)


@pytest.fixture
def docs_txt(tmp_path: Path) -> Path:
    path = tmp_path / "docs.txt"
    path.write_text("\n".join([DOCUMENTS[0], "", DOCUMENTS[1], "   ", *DOCUMENTS[2:]]) + "\n", encoding="utf-8")
    return path


def test_txt_file_gives_one_document_a_line_skipping_blank_lines(docs_txt):
    assert read_documents(str(docs_txt), None, "text") == DOCUMENTS


def test_jsonl_file_reads_the_text_field_or_the_chosen_one(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"body": text, "text": f"#{index}"}) for index, text in enumerate(DOCUMENTS)))

    assert read_documents(str(path), None, "body") == DOCUMENTS
    assert read_documents(str(path), None, "text") == ["#0", "#1", "#2", "#3"]


@pytest.mark.parametrize("content, message", [
    ("", "holds no documents"),
    ('{"text": "ok"}\nnot json\n', "line 2 is not JSON"),
    ('{"body": "no text field"}\n', "no string field 'text'"),
])
def test_bad_docs_files_raise_invalid_request_naming_the_problem(tmp_path, content, message):
    path = tmp_path / "docs.jsonl"
    path.write_text(content)

    with pytest.raises(InvalidRequest, match=message):
        read_documents(str(path), None, "text")


def test_only_newlines_separate_documents(tmp_path):
    path = tmp_path / "docs.jsonl"
    records = [{"text": "one\u2028line"}, {"text": "page\fbreak"}]
    path.write_text("\r\n".join(json.dumps(record, ensure_ascii=False) for record in records), encoding="utf-8")

    assert read_documents(str(path), None, "text") == ["one\u2028line", "page\fbreak"]


@pytest.mark.parametrize("suffix, content", [(".txt", "a\nb\n"), (".jsonl", '{"text": "a"}\n{"text": "b"}\n')])
def test_a_byte_order_mark_is_not_part_of_the_first_document(tmp_path, suffix, content):
    path = tmp_path / f"docs{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + content.encode())
    assert read_documents(str(path), None, "text") == ["a", "b"]


def test_a_file_that_is_not_utf8_raises_invalid_request(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_bytes(b"fine\n\xff\xfe\n")

    with pytest.raises(InvalidRequest, match="not UTF-8 text"):
        read_documents(str(path), None, "text")


def test_table_lists_rank_score_index_and_shortened_text_best_first():
    documents = ["short", "a long document " * 20, "middle"]
    response = ScoreResponse(model="m", results=[ScoreResult(index=0, score=0.1), ScoreResult(index=1, score=0.9),
                                                 ScoreResult(index=2, score=0.5)])
    out = io.StringIO()

    print_table(documents, response, 2, out)

    header, first, second = out.getvalue().splitlines()
    assert header.split() == ["rank", "score", "index", "text"]
    assert first.split()[:3] == ["1", "0.9000", "1"] and first.endswith("...")
    assert second.split() == ["2", "0.5000", "2", "middle"]


def test_json_gives_results_best_first_with_texts():
    response = ScoreResponse(model="m", results=[ScoreResult(index=0, score=0.1), ScoreResult(index=1, score=0.9)],
                             usage=Usage(prompt_tokens=7, computed_tokens=5))

    assert ranking_json("q", ["a", "b"], response, None) == {
        "model": "m", "query": "q",
        "results": [{"rank": 1, "index": 1, "score": 0.9, "text": "b"},
                    {"rank": 2, "index": 0, "score": 0.1, "text": "a"}],
        "usage": {"prompt_tokens": 7, "computed_tokens": 5},
    }


@pytest.mark.parametrize("args, message", [
    (["--docs", "/no/such/file.txt"], "error: --docs: cannot read /no/such/file.txt"),
    (["--docs", "-", "--model", "/no/such/model"], "error: no model folder at '/no/such/model'"),
    (["--docs", "-", "--model", "./no-such-model"], "error: no model folder at './no-such-model'"),
    (["--docs", "-", "--dialect", "cohere"], "error: --dialect: only applies to a server URL"),
    (["--docs", "-", "--model", "http://127.0.0.1:9", "--device", "cpu"], "error: --device: only applies to a local"),
])
def test_errors_print_one_line_and_exit_2(args, message):
    completed = rerankit_cli("rank", "--query", QUERY, *args, stdin="a document\n")

    assert completed.returncode == 2
    assert _last_line(completed.stderr).startswith(message)
    assert "Traceback" not in completed.stderr and completed.stdout == ""


@pytest.mark.parametrize("value", ["0", "x"])
def test_a_bad_flag_value_is_a_usage_error_saying_what_is_expected(value, capsys):
    from rerankit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["rank", "--query", QUERY, "--docs", "-", "--top-n", value])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"argument --top-n: must be a positive integer, got '{value}'" in stderr
    assert "positive_int" not in stderr  # the message says what is expected, not the function's name


def test_version_prints_the_package_version(capsys):
    from rerankit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"rerankit {rerankit.__version__}"


@pytest.mark.parametrize("flag, value, message", [
    ("--batch-window-ms", "-1", "must be a number >= 0, got '-1'"),
    ("--port", "70000", "must be a port number, 0 to 65535, got '70000'"),
    ("--prefix-cache-mib", "-1", "must be an integer >= 0, got '-1'"),
    ("--header-timeout", "inf", "must be a finite number > 0, got 'inf'"),
    ("--header-timeout", "soon", "must be a finite number > 0, got 'soon'"),
])
def test_a_bad_serve_flag_is_a_usage_error_before_the_model_loads(flag, value, message):
    completed = rerankit_cli("serve", "--model", "/no/such/model", flag, value)

    assert completed.returncode == 2 and f"argument {flag}: {message}" in completed.stderr


def _last_line(stderr: str) -> str:
    """The last line of stderr: transformers may draw a weight-loading progress bar above the error."""
    return stderr.strip().splitlines()[-1]


# --- the real engine on the packaged MiniLM, and the server ----------------------------------------------------

def test_rank_prints_a_table_best_first_with_the_default_model(docs_txt):
    completed = rerankit_cli("rank", "--query", QUERY, "--docs", str(docs_txt), "--top-n", "3")

    assert completed.returncode == 0, completed.stderr
    header, *rows = completed.stdout.splitlines()
    assert header.split() == ["rank", "score", "index", "text"]
    assert [row.split()[2] for row in rows] == ["1", "3", "2"]
    assert rows[0].endswith(DOCUMENTS[1]) and float(rows[0].split()[1]) > float(rows[1].split()[1])


@pytest.fixture(scope="module")
def local_ranking(started_early) -> dict:
    """``rerankit rank --json`` over DOCUMENTS on stdin with the default model, parsed."""
    early = started_early.get("local_ranking")
    completed = early.result() if early is not None else _rank_json_on_stdin()
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout)


def test_rank_json_lists_every_document_best_first_with_texts(local_ranking):
    assert [hit["index"] for hit in local_ranking["results"]] == [1, 3, 2, 0]
    assert [hit["rank"] for hit in local_ranking["results"]] == [1, 2, 3, 4]
    assert [hit["text"] for hit in local_ranking["results"]] == [DOCUMENTS[index] for index in (1, 3, 2, 0)]
    assert local_ranking["usage"]["prompt_tokens"] > 0 and local_ranking["query"] == QUERY


def test_rank_jsonl_with_a_text_field_and_top_n_gives_the_best_of_the_same_ranking(tmp_path, local_ranking):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"body": text}) for text in DOCUMENTS))

    completed = rerankit_cli("rank", "--query", QUERY, "--docs", str(jsonl), "--text-field", "body", "--json",
                             "--top-n", "2")

    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)["results"] == local_ranking["results"][:2]


@pytest.fixture(scope="module")
def served_minilm(started_early):
    """``rerankit serve`` on the packaged MiniLM with an API key, on a free loopback port."""
    server, port = started_early.get("served_minilm") or _start_minilm_server()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert server.poll() is None, server.stderr.read()
        assert time.monotonic() < deadline, "rerankit serve did not come up"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    yield url
    server.send_signal(signal.SIGINT)
    server.wait(timeout=30)


def test_serve_then_rank_against_it_gives_the_local_ranking(served_minilm, local_ranking):
    remote = rerankit_cli("rank", "--model", served_minilm, "--api-key", "s3cret", "--query", QUERY,
                          "--docs", "-", "--json", stdin="\n".join(DOCUMENTS))

    assert remote.returncode == 0, remote.stderr
    local_hits, remote_hits = local_ranking["results"], json.loads(remote.stdout)["results"]
    assert [hit["index"] for hit in remote_hits] == [hit["index"] for hit in local_hits]
    assert [hit["score"] for hit in remote_hits] == pytest.approx([hit["score"] for hit in local_hits], abs=1e-5)
    assert json.loads(remote.stdout)["model"] == "minilm"


def test_serve_refuses_a_client_without_the_key(served_minilm):
    completed = rerankit_cli("rank", "--model", served_minilm, "--dialect", "cohere", "--query", QUERY,
                             "--docs", "-", stdin="\n".join(DOCUMENTS))

    assert completed.returncode == 2
    assert _last_line(completed.stderr).startswith("error: HTTP 401")


def test_serve_takes_each_of_several_keys(served_minilm):
    completed = rerankit_cli("rank", "--model", served_minilm, "--api-key", "rotated", "--query", QUERY,
                             "--docs", "-", "--top-n", "1", stdin="\n".join(DOCUMENTS))

    assert completed.returncode == 0, completed.stderr


def test_rank_takes_the_servers_key_from_the_environment(served_minilm):
    completed = rerankit_cli("rank", "--model", served_minilm, "--query", QUERY, "--docs", "-", "--top-n", "1",
                             stdin="\n".join(DOCUMENTS), RERANKIT_API_KEY="s3cret")

    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines()[1].endswith(DOCUMENTS[1])


def test_serve_hands_the_prefix_cache_size_to_the_engine(monkeypatch):
    from rerankit import cli

    given = {}
    monkeypatch.setattr(cli, "serve", lambda model, **options: given.update(options, model=model))
    assert cli.main(["serve", "--model", "some/model", "--prefix-cache-mib", "256"]) == 0
    assert given["prefix_cache_bytes"] == 256 << 20 and given["model"] == "some/model"
    assert cli.main(["serve", "--model", "some/model"]) == 0 and given["prefix_cache_bytes"] is None


def test_serve_hands_template_mode_and_instruction_to_the_engine_as_defaults(monkeypatch, tmp_path):
    from rerankit import cli

    given = {}
    monkeypatch.setattr(cli, "serve", lambda model, **options: given.update(options))
    path = tmp_path / "mine.yaml"
    path.write_text(TEMPLATE_YAML, encoding="utf-8")
    assert cli.main(["serve", "--model", "folder", "--template", str(path), "--mode", "generative",
                     "--instruction", "Find code"]) == 0
    options = given["engine_options"]
    assert options["template"].name == "mine" and options["template"].labels == ("yes", "no")
    assert options["mode"] == "generative" and options["instruction"] == "Find code"
    assert cli.main(["serve", "--model", "folder", "--template", "qwen3-reranker"]) == 0
    assert given["engine_options"] == {"template": "qwen3-reranker"}


def test_serve_hands_the_replica_timeout_to_the_replicas_only(monkeypatch, capsys):
    from rerankit import cli
    from rerankit.reranker import make_backend

    given = {}
    monkeypatch.setattr(cli, "serve", lambda model, **options: given.update(options))
    assert cli.main(["serve", "--model", "folder", "--data-parallel-size", "2", "--replica-timeout", "90"]) == 0
    assert given["engine_options"]["replica_timeout_s"] == 90 and given["data_parallel_size"] == 2
    assert cli.main(["serve", "--model", "folder", "--replica-timeout", "90"]) == 2
    assert "--replica-timeout: applies to engine replicas" in capsys.readouterr().err
    assert cli.main(["serve", "--model", "folder", "--data-parallel-size", "2", "--startup-timeout", "1800"]) == 0
    assert given["engine_options"]["startup_timeout_s"] == 1800
    assert cli.main(["serve", "--model", "folder", "--startup-timeout", "1800"]) == 2
    assert "--startup-timeout: applies to engine replicas" in capsys.readouterr().err
    # where the replicas come to one (data_parallel_size "auto" on one device), the engine in process takes none
    backend = make_backend(None, device="cpu", data_parallel_size="auto", replica_timeout_s=90)
    try:
        assert type(backend).__name__ == "EmbeddedBackend"
    finally:
        backend.close()


# --- templates and render -----------------------------------------------------------------------------------

TEMPLATE_YAML = """\
name: mine
prefix_format: "Question: {query}\\n"
item_format: "Passage: {doc}"
suffix_format: "\\nRelevant (yes/no)?"
labels: ["yes", "no"]
"""


def test_templates_lists_names_model_families_and_labels(capsys, tmp_path):
    from rerankit.cli import main

    assert main(["templates"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "models", "labels"]
    assert any(line.split()[:3] == ["qwen3-reranker", "qwen3-reranker", "(Qwen3*)"] and line.endswith("yes,no")
               for line in lines)
    path = tmp_path / "mine.yaml"
    path.write_text(TEMPLATE_YAML, encoding="utf-8")
    assert main(["templates", "--template-file", str(path), "--json"]) == 0
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    assert listed["mine"]["prefix_format"] == "Question: {query}\n" and listed["mine"]["labels"] == ["yes", "no"]


def test_a_bad_template_file_names_the_piece_and_exits_2(capsys, tmp_path):
    from rerankit.cli import main

    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"name": "bad", "prefix_format": "{question}", "item_format": "{doc}",
                                "suffix_format": "", "labels": ["yes"]}), encoding="utf-8")
    assert main(["templates", "--template-file", str(path)]) == 2
    assert capsys.readouterr().err == ("error: template.prefix_format: has the placeholder(s) {question}; it may "
                                       "hold {instruction}, {query}\n")
    unquoted = tmp_path / "unquoted.yaml"
    unquoted.write_text(TEMPLATE_YAML.replace('["yes", "no"]', "[yes, no]"), encoding="utf-8")
    assert main(["render", "--query", "q", "--docs", str(path), "--template-file", str(unquoted)]) == 2
    assert "quote them" in capsys.readouterr().err


def test_render_shows_the_scored_text_ids_cut_and_label_position(capsys, tmp_path, tiny_qwen3_lm):
    from rerankit.cli import main

    docs = tmp_path / "docs.txt"
    docs.write_text("Paris is the capital of France.\n" + "the quick brown fox " * 800 + "\n", encoding="utf-8")
    template = tmp_path / "mine.yaml"
    template.write_text(TEMPLATE_YAML, encoding="utf-8")
    assert main(["render", "--model", str(tiny_qwen3_lm), "--query", "capital of France?", "--docs", str(docs),
                 "--template-file", str(template), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["template"] == "mine" and [label["token"] for label in shown["labels"]] == ["yes", "no"]
    first, long = shown["items"]
    sequence = first["sequences"][0]
    assert sequence["text"] == "Question: capital of France?\nPassage: Paris is the capital of France.\n" \
                               "Relevant (yes/no)?"
    assert sequence["tokens"] == len(sequence["token_ids"]) and sequence["read_position"] == sequence["tokens"] - 1
    assert first["cut_tokens"] == 0 and long["cut_tokens"] > 0
    assert long["sequences"][0]["tokens"] == 2048  # cut to the model's length, the suffix kept
    assert long["sequences"][0]["text"].endswith("\nRelevant (yes/no)?")
    assert main(["render", "--model", str(tiny_qwen3_lm), "--query", "q", "--docs", str(docs),
                 "--long-documents", "max", "--window-tokens", "500"]) == 0
    text = capsys.readouterr().out
    assert "template: qwen3-reranker" in text and "scored in windows" in text and "window 7:" in text


def test_rank_with_a_template_file_scores_as_the_same_template_given_in_the_request(tmp_path, tiny_qwen3_lm,
                                                                                    capsys):
    from rerankit import Reranker
    from rerankit.cli import main
    from rerankit.templates import load_template_file

    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(DOCUMENTS) + "\n", encoding="utf-8")
    template = tmp_path / "mine.yaml"
    template.write_text(TEMPLATE_YAML, encoding="utf-8")
    assert main(["rank", "--model", str(tiny_qwen3_lm), "--device", "cpu", "--query", QUERY, "--docs", str(docs),
                 "--template", str(template), "--json"]) == 0
    ranked = [(entry["index"], entry["score"]) for entry in json.loads(capsys.readouterr().out)["results"]]
    with Reranker(str(tiny_qwen3_lm), device="cpu") as reranker:
        pieces = dataclasses.asdict(load_template_file(template))
        expected = reranker.rank(QUERY, DOCUMENTS, template=pieces)
    assert ranked == [(entry.index, pytest.approx(entry.score, abs=1e-6)) for entry in expected]


@pytest.mark.parametrize("offline", [True, False])
def test_a_hub_id_missing_from_the_cache_fails_at_once_in_one_line(monkeypatch, capsys, tmp_path, offline):
    from huggingface_hub import constants

    from rerankit import hub
    from rerankit.cli import main

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    # a refused connection answers at once: the check does not wait out its bound (a slow box has 30 s to spare)
    monkeypatch.setattr(hub, "HUB_CHECK_SECONDS", 60)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: the hub is unreachable
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    docs = tmp_path / "docs.txt"
    docs.write_text("a document\n", encoding="utf-8")
    started = time.monotonic()
    assert main(["rank", "--model", "nobody/no-such-reranker", "--query", "q", "--docs", str(docs)]) == 2
    assert time.monotonic() - started < 30
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "'nobody/no-such-reranker' is not in the local Hugging Face cache" in error
    assert ("HF_HUB_OFFLINE" in error) == offline and "pass the model's folder" in error


def test_the_hub_check_sees_a_listening_endpoint_and_a_refused_one(monkeypatch):
    from rerankit import hub

    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        assert hub._hub_reachable(f"http://127.0.0.1:{port}")
    assert not hub._hub_reachable(f"http://127.0.0.1:{port}")  # closed now: refused
