"""The CLI and offline scoring at their edges: user errors end in one line, the command line wins over the
environment, and ``score`` gives back every row as written, never leaving a half-written output."""

from __future__ import annotations

import json
import math

import pytest

pyarrow = pytest.importorskip("pyarrow")
import pyarrow.parquet as parquet  # noqa: E402

from rerankit import cli  # noqa: E402
from rerankit.cli import main  # noqa: E402
from rerankit.flags_from_env import PREFIX  # noqa: E402


@pytest.fixture
def served(monkeypatch):
    given: dict = {}
    monkeypatch.setattr(cli, "serve", lambda model, **options: given.update(options, model=model))
    for name in [name for name in __import__("os").environ if name.startswith(PREFIX)]:
        monkeypatch.delenv(name)
    return given


def test_an_empty_api_key_is_refused_not_taken_for_no_key(served, capsys):
    assert main(["serve", "--api-key", ""]) == 2
    assert "--api-key" in capsys.readouterr().err and served == {}


def test_a_bad_variable_gives_way_to_its_flag_on_the_command_line(served, monkeypatch, capsys):
    monkeypatch.setenv("RERANKIT_PORT", "tcp://10.96.0.12:8000")  # Kubernetes' service link for a Service "rerankit"
    assert main(["serve", "--port", "9001"]) == 0 and served["port"] == 9001
    served.clear()
    assert main(["serve"]) == 2
    assert "$RERANKIT_PORT" in capsys.readouterr().err and served == {}


def test_a_template_on_the_command_line_wins_over_the_other_kind_in_the_environment(served, monkeypatch, tmp_path):
    template = tmp_path / "mine.yaml"
    template.write_text('name: mine\nprefix_format: "Q: {query}"\nitem_format: "D: {doc}"\nsuffix_format: ""\n'
                        'labels: ["yes"]\n')
    monkeypatch.setenv("RERANKIT_TEMPLATE_FILE", str(template))
    assert main(["serve", "--template", "qwen3-reranker"]) == 0
    assert served["engine_options"]["template"] == "qwen3-reranker"


def test_a_closed_stdout_and_ctrl_c_end_without_a_traceback(monkeypatch, capsys):
    def broken(args):
        raise BrokenPipeError

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_templates", broken)
    assert main(["templates"]) == 141
    monkeypatch.setattr(cli, "run_templates", interrupted)
    assert main(["templates"]) == 130 and capsys.readouterr().err == "error: interrupted\n"


def _score(tmp_path, source, output, model, *flags):
    return main(["score", "--input", str(source), "--output", str(tmp_path / output), "--model", str(model),
                 "--device", "cpu", "--no-progress", *flags])


def test_csv_cells_come_back_as_written_and_may_hold_newlines(tmp_path, tiny_bert_cross_encoder):
    source = tmp_path / "pairs.csv"
    lines = "".join(f'q{row % 3},"line one {row}\nline two{" and more" * 150}",{row:05d},7\n' for row in range(900))
    source.write_text("query,document,id,count\n" + lines + 'q0,"a\nb",N/A,8\n')  # over 1 MiB
    assert source.stat().st_size > 1 << 20
    assert _score(tmp_path, source, "out.csv", tiny_bert_cross_encoder) == 0
    import csv
    rows = list(csv.DictReader(open(tmp_path / "out.csv", newline="")))
    assert [row["id"] for row in rows] == [f"{row:05d}" for row in range(900)] + ["N/A"]
    assert rows[0]["document"].startswith("line one 0\nline two") and rows[-1]["count"] == "8"
    table = __import__("rerankit.offline", fromlist=["read_table"]).read_table(source, ("query", "document"))
    assert table.schema.field("count").type == pyarrow.int64()  # lossless columns keep their type


def test_a_jsonl_row_longer_than_a_read_block_is_read(tmp_path, tiny_bert_cross_encoder):
    source = tmp_path / "pairs.jsonl"
    source.write_text(json.dumps({"query": "q", "document": "a"}) + "\n"
                      + json.dumps({"query": "q", "document": "clause " * 700000}) + "\n")
    assert _score(tmp_path, source, "out.jsonl", tiny_bert_cross_encoder) == 0
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("content, row", [("query,document\nq,a\n ,b\n", 2), ("query,document\n,a\n", 1)])
def test_a_blank_query_names_its_row_before_anything_is_scored(tmp_path, capsys, content, row):
    source = tmp_path / "pairs.csv"
    source.write_text(content)
    assert main(["score", "--input", str(source), "--output", str(tmp_path / "o.jsonl"), "--no-progress"]) == 2
    assert f"row {row}: column 'query' is empty" in capsys.readouterr().err


@pytest.mark.parametrize("content, flags, message", [
    ("query,document,document\nq,a,b\n", [], "2 columns named 'document'"),
    ("query,document\nq,a\n", ["--score-column", "document"], "--score-column"),
])
def test_clashing_columns_are_one_line_errors(tmp_path, capsys, content, flags, message):
    source = tmp_path / "pairs.csv"
    source.write_text(content)
    assert main(["score", "--input", str(source), "--output", str(tmp_path / "o.jsonl"), "--no-progress",
                 *flags]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error


def test_an_output_that_cannot_hold_the_table_is_refused_before_scoring_and_left_as_it_was(tmp_path, capsys,
                                                                                           monkeypatch):
    source, target = tmp_path / "pairs.jsonl", tmp_path / "out.csv"
    source.write_text('{"query": "q", "document": "a", "meta": {"k": 1}}\n')
    target.write_text("earlier results")
    monkeypatch.setattr("rerankit.offline.offline_backend", lambda *a, **k: pytest.fail("scored"))
    assert main(["score", "--input", str(source), "--output", str(target), "--no-progress"]) == 2
    assert "CSV cannot hold" in capsys.readouterr().err and target.read_text() == "earlier results"


def test_a_failed_write_leaves_the_earlier_file_whole(tmp_path, monkeypatch):
    from rerankit.offline import write_table

    target = tmp_path / "out.jsonl"
    target.write_text("earlier results")
    monkeypatch.setattr("rerankit.table_files._json_safe", lambda row: (_ for _ in ()).throw(OSError(28, "disk full")))
    with pytest.raises(Exception, match="cannot write"):
        write_table(pyarrow.table({"a": [1]}), target)
    assert target.read_text() == "earlier results" and [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_jsonl_output_writes_non_finite_numbers_as_null(tmp_path, tiny_bert_cross_encoder):
    source = tmp_path / "pairs.parquet"
    parquet.write_table(pyarrow.table({"query": ["q", "q"], "document": ["a", "b"], "w": [math.nan, math.inf]}),
                        source)
    assert _score(tmp_path, source, "out.jsonl", tiny_bert_cross_encoder) == 0
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(c))
            for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [row["w"] for row in rows] == [None, None]


def test_rank_reads_an_upper_case_jsonl_suffix_as_jsonl(tmp_path):
    source = tmp_path / "corpus.JSONL"
    source.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert cli.read_documents(str(source), None, "text") == ["a", "b"]
