"""``rerankit score`` without Ray: a pairs file in, the same rows with their scores out, grouped by query."""

from __future__ import annotations

import json

import pytest

pyarrow = pytest.importorskip("pyarrow")
import pyarrow.parquet as parquet  # noqa: E402

from rerankit import Reranker  # noqa: E402
from rerankit.cli import main  # noqa: E402
from rerankit.offline import CALL_ITEMS, _calls  # noqa: E402
from rerankit.schema import ScoreRequest  # noqa: E402

ROWS = [{"id": row, "q": f"query {row % 3} about paris", "text": f"document {row} on the capital of france"}
        for row in range(40)]


def test_score_writes_every_row_with_the_score_reranker_gives(tmp_path, tiny_bert_cross_encoder, capsys) -> None:
    source, target = tmp_path / "pairs.parquet", tmp_path / "scored.jsonl"
    parquet.write_table(pyarrow.Table.from_pylist(ROWS), source)

    code = main(["score", "--input", str(source), "--output", str(target), "--model", str(tiny_bert_cross_encoder),
                 "--device", "cpu", "--query-column", "q", "--document-column", "text", "--no-progress"])

    assert code == 0 and "scored 40 pairs" in capsys.readouterr().err
    scored = [json.loads(line) for line in target.read_text().splitlines()]
    assert [row["id"] for row in scored] == list(range(40))
    with Reranker(str(tiny_bert_cross_encoder), device="cpu") as reranker:
        for query in {row["q"] for row in ROWS}:
            mine = [row for row in scored if row["q"] == query]
            expected = reranker.score(ScoreRequest(query=query, items=[row["text"] for row in mine])).scores
            assert [row["score"] for row in mine] == pytest.approx(expected, abs=1e-6)


def test_score_with_a_server_url_scores_there(tmp_path, tiny_bert_cross_encoder, capsys) -> None:
    from live_server import live_server

    from rerankit.engine import EmbeddedBackend
    from rerankit.server.app import create_app

    source, target = tmp_path / "pairs.jsonl", tmp_path / "scored.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in ROWS[:6]))
    engine = EmbeddedBackend(str(tiny_bert_cross_encoder), device="cpu")
    try:
        with live_server(create_app(engine)) as url:
            assert main(["score", "--input", str(source), "--output", str(target), "--model", url,
                         "--device", "cpu"]) == 2
            assert "--device: only applies to a local model" in capsys.readouterr().err
            assert main(["score", "--input", str(source), "--output", str(target), "--model", url,
                         "--query-column", "q", "--document-column", "text", "--no-progress"]) == 0
        scored = [json.loads(line) for line in target.read_text().splitlines()]
        for query in {row["q"] for row in scored}:
            mine = [row for row in scored if row["q"] == query]
            expected = engine.score(ScoreRequest(query=query, items=[row["text"] for row in mine])).scores
            assert [row["score"] for row in mine] == pytest.approx(expected, abs=1e-5)
    finally:
        engine.close()


def test_score_names_a_missing_column(tmp_path, capsys) -> None:
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in ROWS))

    assert main(["score", "--input", str(source), "--output", str(tmp_path / "out.csv")]) == 2
    assert "no column 'query'" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--concurrency", "2"), ("--num-gpus", "1"), ("--batch-size", "64")])
def test_score_refuses_ray_flags_without_ray(tmp_path, capsys, flag, value) -> None:
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in ROWS))

    assert main(["score", "--input", str(source), "--output", str(tmp_path / "out.csv"), flag, value]) == 2
    assert f"{flag}: only applies with --ray" in capsys.readouterr().err


def test_calls_keep_query_runs_whole_and_bounded() -> None:
    runs = [(f"q{number}", list(range(size))) for number, size in enumerate([1000, 1000, 100, 3000, 5])]
    calls = _calls(runs)
    assert [run for call in calls for run in call] == runs
    assert all(sum(len(rows) for _, rows in call) <= CALL_ITEMS or len(call) == 1 for call in calls)


@pytest.mark.parametrize("output, message", [("scored.txt", "must end in one of"),
                                             ("no/such/folder/scored.jsonl", "does not exist")])
def test_a_bad_output_is_refused_before_any_row_is_scored(tmp_path, capsys, monkeypatch, output, message) -> None:
    import rerankit.offline

    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps({"query": row["q"], "document": row["text"]}) + "\n" for row in ROWS))
    monkeypatch.setattr(rerankit.offline, "offline_backend", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["score", "--input", str(source), "--output", str(tmp_path / output)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--output" in error and message in error


MISSING = {"jsonl null": '{"query": "q", "document": "a"}\n{"query": "q", "document": null}\n',
           "jsonl absent": '{"query": "q", "document": "a"}\n{"query": "q"}\n'}


@pytest.mark.parametrize("case", [*MISSING, "parquet null"])
def test_a_missing_document_is_refused_in_every_format_naming_its_row_and_column(tmp_path, capsys, monkeypatch,
                                                                                 case) -> None:
    source = tmp_path / f"pairs.{case.split()[0]}"
    if case == "parquet null":
        parquet.write_table(pyarrow.table({"query": ["q", "q"], "document": ["a", None]}), source)
    else:
        source.write_text(MISSING[case])
    monkeypatch.setattr("rerankit.offline.offline_backend", lambda *a, **k: pytest.fail("scored"))
    assert main(["score", "--input", str(source), "--output", str(tmp_path / "out.jsonl")]) == 2
    assert "row 2: column 'document' has no value" in capsys.readouterr().err


@pytest.mark.parametrize("name, content", [("pairs.jsonl", '{"query": "q", "document": "a"}\n'
                                                           '{"query": "q", "document": ""}\n'),
                                           ("pairs.csv", 'query,document\nq,a\nq,""\n'),
                                           ("pairs.csv", 'query,document\nq,a\nq,\n')])
def test_an_empty_text_is_a_document_as_the_python_api_takes_it(tmp_path, name, content) -> None:
    from rerankit.offline import read_table, text_column

    source = tmp_path / name
    source.write_text(content)
    assert text_column(read_table(source, ("query", "document")), "document", "--document-column") == ["a", ""]
    ScoreRequest(query="q", items=["a", ""])  # what rank, the server and the Python API score


def test_numbers_in_the_text_columns_are_scored_as_text(tmp_path, tiny_bert_cross_encoder) -> None:
    csv_source, jsonl_source = tmp_path / "pairs.csv", tmp_path / "pairs.jsonl"
    csv_source.write_text("query,document\n2024,1000\n2024,42\n")
    jsonl_source.write_text('{"query": 2024, "document": 1000}\n{"query": 2024, "document": 42.5}\n')
    for source in (csv_source, jsonl_source):
        target = tmp_path / f"out{source.suffix}.jsonl"
        assert main(["score", "--input", str(source), "--output", str(target), "--model",
                     str(tiny_bert_cross_encoder), "--device", "cpu", "--no-progress"]) == 0
        scored = [json.loads(line) for line in target.read_text().splitlines()]
        with Reranker(str(tiny_bert_cross_encoder), device="cpu") as reranker:
            documents = ["1000", "42"] if source is csv_source else ["1000", "42.5"]
            expected = reranker.score(ScoreRequest(query="2024", items=documents)).scores
        assert [row["score"] for row in scored] == pytest.approx(expected, abs=1e-5)
