"""The ``rerankit`` command line, run as a subprocess the way a user runs it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rerankit
from rerankit.cli import print_table, ranking_json, read_documents
from rerankit.errors import InvalidRequest
from rerankit.schema import ScoreResponse, ScoreResult, Usage

# The child must import this checkout's rerankit whether or not it is pip-installed.
CHILD_ENV = {**os.environ, "PYTHONPATH": str(Path(rerankit.__file__).parents[1]),
             "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Bananas are an excellent source of potassium.",
    "Paris is the capital and most populous city of France.",
    "A car engine converts the chemical energy of fuel into motion.",
    "Berlin is the capital of Germany.",
]


def rerankit_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rerankit", *args], input=stdin, capture_output=True, text=True,
                          timeout=120, env=CHILD_ENV)


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
        "results": [{"rank": 1, "index": 1, "score": 0.9, "text": "b"}, {"rank": 2, "index": 0, "score": 0.1, "text": "a"}],
        "usage": {"prompt_tokens": 7, "computed_tokens": 5},
    }


@pytest.mark.parametrize("args, message", [
    (["--docs", "/no/such/file.txt"], "error: --docs: cannot read /no/such/file.txt"),
    (["--docs", "-", "--top-n", "0"], "error: --top-n: must be >= 1"),
])
def test_errors_print_one_line_and_exit_2(args, message):
    completed = rerankit_cli("rank", "--query", QUERY, *args, stdin="")

    assert completed.returncode == 2
    assert completed.stderr.strip() == completed.stderr.strip().splitlines()[0]
    assert completed.stderr.startswith(message)
    assert "Traceback" not in completed.stderr and completed.stdout == ""
