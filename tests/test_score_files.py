"""``rerankit score``'s files: gzipped input and output, stdin and stdout as ``-``, and JSONL numbers written back as
they were written. A backend that scores each document by its length stands in for a model (no model loads)."""

from __future__ import annotations

import gzip
import io
import json
import sys

import pytest

pyarrow = pytest.importorskip("pyarrow")
import pyarrow.parquet as parquet  # noqa: E402

from rerankit import offline  # noqa: E402
from rerankit.cli import main  # noqa: E402
from rerankit.schema import ScoreResponse, ScoreResult  # noqa: E402
from rerankit.score_journal import journal_path  # noqa: E402

ROWS = [{"id": row, "query": f"q{row % 3}", "document": "d" * row} for row in range(1, 9)]


class Lengths:
    """Scores each document by its length; raises KeyboardInterrupt on the call after ``calls`` calls."""

    def __init__(self, calls=None):
        self.calls, self.rows = calls, 0

    def score_batch(self, requests):
        if self.calls == 0:
            raise KeyboardInterrupt
        if self.calls is not None:
            self.calls -= 1
        self.rows += sum(len(request.items) for request in requests)
        return [ScoreResponse(model="lengths", results=[ScoreResult(index=index, score=float(len(item)))
                                                        for index, item in enumerate(request.items)])
                for request in requests]

    def close(self):
        pass


@pytest.fixture
def backends(monkeypatch):
    """The backends the runs made; ``backends.next_calls`` sets how many calls the next one answers."""
    made = []

    def make(*args, **kwargs):
        made.append(Lengths(getattr(make, "next_calls", None)))
        make.next_calls = None
        return made[-1]

    monkeypatch.setattr(offline, "offline_backend", make)
    make.made = made
    return make


def _jsonl(rows):
    return "".join(json.dumps(row) + "\n" for row in rows)


def _csv(rows):
    return "id,query,document\n" + "".join(f"{row['id']},{row['query']},{row['document']}\n" for row in rows)


def _stdin(monkeypatch, data: bytes):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_gzipped_input_and_output_are_read_and_written(tmp_path, backends, suffix):
    source, target = tmp_path / f"pairs{suffix}.gz", tmp_path / f"scored{suffix}.gz"
    source.write_bytes(gzip.compress((_jsonl if suffix == ".jsonl" else _csv)(ROWS).encode()))

    assert main(["score", "--input", str(source), "--output", str(target), "--no-progress"]) == 0

    with gzip.open(target, "rt") as packed:
        text = packed.read()
    if suffix == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines()]
    else:
        import csv

        rows = [{**row, "id": int(row["id"]), "score": float(row["score"])} for row in csv.DictReader(io.StringIO(text))]
    assert rows == [{**row, "score": float(len(row["document"]))} for row in ROWS]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([source.name, target.name])  # no journal left


def test_a_stopped_run_into_a_gzipped_output_goes_on_where_it_stopped(tmp_path, backends, monkeypatch, capsys):
    source, target = tmp_path / "pairs.jsonl", tmp_path / "scored.jsonl.gz"
    source.write_text(_jsonl(ROWS))
    monkeypatch.setattr(offline, "CALL_ITEMS", 2)
    command = ["score", "--input", str(source), "--output", str(target), "--no-progress"]

    backends.next_calls = 1
    assert main(command) == 130 and journal_path(target).exists() and not target.exists()
    first = backends.made[-1].rows
    assert main(command) == 0
    assert backends.made[-1].rows == len(ROWS) - first and "were scored by an earlier run" in capsys.readouterr().err
    with gzip.open(target, "rt") as packed:
        assert [json.loads(line)["score"] for line in packed] == [float(row["id"]) for row in ROWS]


@pytest.mark.parametrize("damage, why", [(lambda packed: packed[:len(packed) // 2], "cut short or damaged"),
                                         (lambda packed: packed[:-8], "cut short or damaged"),
                                         (lambda packed: gzip.decompress(packed), "it is not gzip")],
                         ids=["cut in half", "no trailer", "not gzipped"])
@pytest.mark.parametrize("suffix", [".jsonl.gz", ".csv.gz"])
def test_a_damaged_gzip_input_is_a_one_line_error_naming_it(tmp_path, backends, capsys, damage, why, suffix):
    source = tmp_path / f"pairs{suffix}"
    text = (_jsonl if suffix == ".jsonl.gz" else _csv)(ROWS * 400)
    source.write_bytes(damage(gzip.compress(text.encode())))

    assert main(["score", "--input", str(source), "--output", str(tmp_path / "out.jsonl"), "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"--input: cannot read {source}" in error and why in error
    assert backends.made == []


def test_a_gzipped_parquet_name_is_refused(tmp_path, backends, capsys):
    source = tmp_path / "pairs.jsonl"
    source.write_text(_jsonl(ROWS))
    assert main(["score", "--input", str(source), "--output", str(tmp_path / "out.parquet.gz")]) == 2
    assert "--output" in (error := capsys.readouterr().err) and "drop the .gz" in error


@pytest.mark.parametrize("file_format, parse", [
    ("jsonl", lambda text: [json.loads(line) for line in text.splitlines()]),
    ("csv", lambda text: [{**row, "id": int(row["id"]), "score": float(row["score"])}
                          for row in __import__("csv").DictReader(io.StringIO(text))]),
])
def test_stdin_to_stdout_writes_only_the_table_there(tmp_path, backends, monkeypatch, capsys, file_format, parse):
    monkeypatch.chdir(tmp_path)
    _stdin(monkeypatch, (_jsonl if file_format == "jsonl" else _csv)(ROWS).encode())

    assert main(["score", "--input", "-", "--output", "-", "--format", file_format]) == 0  # with a progress bar

    out, err = capsys.readouterr()
    assert parse(out) == [{**row, "score": float(len(row["document"]))} for row in ROWS]
    assert "scored 8 pairs into stdout" in err and "rerankit score: 100%" in err
    assert list(tmp_path.iterdir()) == []  # no journal, nothing beside


def test_a_stopped_run_to_stdout_writes_nothing_and_keeps_no_journal(tmp_path, backends, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(offline, "CALL_ITEMS", 2)
    _stdin(monkeypatch, _jsonl(ROWS).encode())
    backends.next_calls = 1
    assert main(["score", "--input", "-", "--output", "-", "--format", "jsonl", "--no-progress"]) == 130
    assert capsys.readouterr().out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("file_format", ["jsonl", "csv", "parquet"])
def test_a_closed_stdout_ends_quietly(tmp_path, backends, monkeypatch, capsys, file_format):
    class Closed(io.RawIOBase):
        def writable(self):
            return True

        def write(self, data):
            raise BrokenPipeError(32, "Broken pipe")

    source = tmp_path / "pairs.jsonl"
    source.write_text(_jsonl(ROWS))
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BufferedWriter(Closed(), 16)))
    assert main(["score", "--input", str(source), "--output", "-", "--format", file_format, "--no-progress"]) == 141
    assert "error" not in capsys.readouterr().err


def test_stdout_takes_the_input_files_format(tmp_path, backends, capsys):
    source = tmp_path / "pairs.csv.gz"
    source.write_bytes(gzip.compress(_csv(ROWS).encode()))
    assert main(["score", "--input", str(source), "--output", "-", "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == ['"id","query","document","score"', '1,"q1","d",1']


@pytest.mark.parametrize("flags, message", [
    (["--input", "-", "--output", "out.jsonl"], "--input: - has no suffix to tell its format: give --format"),
    (["--input", "pairs.jsonl", "--output", "out.jsonl", "--format", "csv"], "--format: only applies to -"),
    (["--input", "-", "--output", "out/", "--format", "csv", "--ray"], "--input: with --ray"),
])
def test_stdio_flags_that_cannot_apply_are_refused(tmp_path, backends, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs.jsonl").write_text(_jsonl(ROWS))
    assert main(["score", *flags, "--no-progress"]) == 2
    assert message in capsys.readouterr().err and backends.made == []


def test_a_stopped_run_from_stdin_goes_on_when_the_same_rows_come_again(tmp_path, backends, monkeypatch):
    target = tmp_path / "scored.jsonl"
    monkeypatch.setattr(offline, "CALL_ITEMS", 2)
    command = ["score", "--input", "-", "--format", "jsonl", "--output", str(target), "--no-progress"]

    _stdin(monkeypatch, _jsonl(ROWS).encode())
    backends.next_calls = 1
    assert main(command) == 130 and journal_path(target).exists()
    first = backends.made[-1].rows
    _stdin(monkeypatch, _jsonl(ROWS).encode())
    assert main(command) == 0 and backends.made[-1].rows == len(ROWS) - first

    changed = [{**row, "document": row["document"] + "!"} for row in ROWS]
    _stdin(monkeypatch, _jsonl(changed).encode())
    backends.next_calls = 1
    assert main(command) == 130
    _stdin(monkeypatch, _jsonl(ROWS).encode())  # not the rows the journal holds: scored afresh
    assert main(command) == 0 and backends.made[-1].rows == len(ROWS)


def test_jsonl_numbers_come_back_as_written(tmp_path, backends):
    source = tmp_path / "pairs.jsonl"
    values, documents = [1000, 2.5, 12345678901234567890, None, -7, 1e-3], [1000, 42.5, 7, 1, 1, 1]
    source.write_text("".join(json.dumps({"query": "q", "document": document, "n": value}) + "\n"
                              for document, value in zip(documents, values)))

    assert main(["score", "--input", str(source), "--output", str(tmp_path / "out.jsonl"), "--no-progress"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [row["n"] for row in rows] == values and [type(row["n"]) for row in rows] == [type(v) for v in values]
    assert [row["document"] for row in rows] == documents and type(rows[0]["document"]) is int
    assert [row["score"] for row in rows[:3]] == [4.0, 4.0, 1.0]  # "1000", "42.5", "7" as written, not "1000.0"

    assert main(["score", "--input", str(source), "--output", str(tmp_path / "out.parquet"), "--no-progress"]) == 0
    table = parquet.read_table(tmp_path / "out.parquet")
    assert table.schema.field("n").type == pyarrow.float64() and table.column("n").to_pylist()[:2] == [1000.0, 2.5]


def test_a_run_leaves_the_temporary_file_of_an_output_named_as_its_own_and_more(tmp_path, backends):
    source, target = tmp_path / "pairs.jsonl", tmp_path / "scored.jsonl"
    source.write_text(_jsonl(ROWS))
    live = tmp_path / ".scored.jsonl.gz.4242.0123456789ab.tmp"  # a run writing scored.jsonl.gz beside it
    stale = tmp_path / ".scored.jsonl.4242.0123456789ab.tmp"  # a run of this output, killed while writing
    live.write_bytes(b"being written")
    stale.write_bytes(b"left behind")
    assert main(["score", "--input", str(source), "--output", str(target), "--no-progress"]) == 0
    assert live.read_bytes() == b"being written" and not stale.exists()


@pytest.mark.parametrize("stream, flags", [("stdout", ["--output", "-"]), ("stdin", ["--input", "-"])])
def test_a_closed_stdin_or_stdout_is_refused_before_scoring(tmp_path, backends, monkeypatch, capsys, stream, flags):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs.jsonl").write_text(_jsonl(ROWS))
    monkeypatch.setattr(sys, stream, None)  # started with it closed (>&- or <&-)
    command = {"--input": "pairs.jsonl", "--output": "out.jsonl", **dict([flags])}
    assert main(["score", *[part for pair in command.items() for part in pair], "--format", "jsonl"]) == 2
    assert f"{flags[0]}: {stream} is closed" in capsys.readouterr().err and backends.made == []


@pytest.mark.parametrize("progress", [[], ["--no-progress"]])
def test_with_stderr_closed_only_the_table_goes_to_stdout(tmp_path, backends, monkeypatch, capsys, progress):
    source = tmp_path / "pairs.jsonl"
    source.write_text(_jsonl(ROWS))
    monkeypatch.setattr(sys, "stderr", None)  # started with it closed (2>&-)
    assert main(["score", "--input", str(source), "--output", "-", *progress]) == 0
    assert [json.loads(line)["id"] for line in capsys.readouterr().out.splitlines()] == [row["id"] for row in ROWS]


def _score_jsonl(tmp_path, text, output="out.jsonl"):
    """``rerankit score`` of a JSONL file holding ``text``: the exit status and the output's rows (JSONL)."""
    source, target = tmp_path / "pairs.jsonl", tmp_path / output
    source.write_bytes(text if isinstance(text, bytes) else text.encode())
    code = main(["score", "--input", str(source), "--output", str(target), "--no-progress"])
    if code or output != "out.jsonl":
        return code, None
    return code, [json.loads(line) for line in target.read_text().splitlines()]


@pytest.mark.parametrize("row, column", [(b'{"query": "q", "document": "caf\xe9"}', "document"),
                                         (b'{"query": "q", "document": "d", "m": {"k": "caf\xe9"}}', "m")])
def test_text_that_is_not_utf8_is_a_one_line_error_before_scoring(tmp_path, backends, capsys, row, column):
    assert _score_jsonl(tmp_path, row + b"\n")[0] == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"column {column!r} holds text that is not UTF-8" in error
    assert backends.made == []


@pytest.mark.parametrize("column", ["document", "note"])
def test_csv_text_that_is_not_utf8_is_named_by_its_column(tmp_path, backends, capsys, column):
    source = tmp_path / "pairs.csv"
    cells = {"query": b"q", "document": b"d", "note": b"n", column: b"caf\xe9"}
    source.write_bytes(b"query,document,note\n" + b",".join(cells.values()) + b"\n")
    assert main(["score", "--input", str(source), "--output", str(tmp_path / "out.csv"), "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"column {column!r} holds text that is not UTF-8" in error
    assert backends.made == []


@pytest.mark.parametrize("file_format", ["jsonl", "csv"])
def test_gzipped_stdin_is_read(tmp_path, backends, monkeypatch, capsys, file_format):
    monkeypatch.chdir(tmp_path)
    packed = gzip.compress((_jsonl if file_format == "jsonl" else _csv)(ROWS).encode())
    _stdin(monkeypatch, packed)
    assert main(["score", "--input", "-", "--output", "-", "--format", file_format, "--no-progress"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(ROWS) + (file_format == "csv")
    _stdin(monkeypatch, packed[:-8])
    assert main(["score", "--input", "-", "--output", "-", "--format", file_format, "--no-progress"]) == 2
    assert "the gzip data on stdin is cut short or damaged" in capsys.readouterr().err


@pytest.mark.parametrize("rows", [
    ['{"query": "q", "document": "a", "n": 1}', '{"query": "q", "document": "b", "n": NaN}'],
    ['{"query": "q", "document": "a", "\\u006E" :\t1 }', '{"query": "q", "document": "b", "n": 2.5}'],
], ids=["beside NaN", "under an escaped key"])
def test_an_int_stays_an_int(tmp_path, backends, rows):
    code, out = _score_jsonl(tmp_path, "\n".join(rows) + "\n")
    assert code == 0 and out[0]["n"] == 1 and type(out[0]["n"]) is int


def test_nested_numbers_come_back_as_written(tmp_path, backends, capsys):
    text = ('{"query": "q", "document": "a", "m": {"w": 1, "l": [2, 0.5]}, "s": [{"z": 3}], "k": {"r": 1}}\n'
            '{"query": "q", "document": "b", "m": {"w": 2.5}, "s": [{"z": 0.25}, {}], "k": {"r": 2}}\n'
            '{"query": "q", "document": "c", "m": null, "s": null, "k": null}\n')
    code, out = _score_jsonl(tmp_path, text)
    assert code == 0 and [(row["m"], row["s"]) for row in out] == [
        ({"w": 1, "l": [2, 0.5]}, [{"z": 3}]), ({"w": 2.5}, [{"z": 0.25}, {}]), (None, None)]
    assert [type(number) for number in (out[0]["m"]["w"], out[0]["m"]["l"][0], out[0]["s"][0]["z"])] == [int] * 3

    assert _score_jsonl(tmp_path, text, "out.parquet")[0] == 0  # Parquet: the types pyarrow reads
    table = parquet.read_table(tmp_path / "out.parquet")
    assert table.schema.field("m").type.field("w").type == pyarrow.float64()
    assert table.column("m").to_pylist()[:2] == [{"w": 1.0, "l": [2.0, 0.5]}, {"w": 2.5, "l": None}]
    assert _score_jsonl(tmp_path, text, "out.csv")[0] == 2 and "CSV cannot hold" in capsys.readouterr().err


def test_floats_written_as_floats_are_not_read_again_line_by_line(tmp_path, backends, monkeypatch):
    from rerankit import json_numbers

    monkeypatch.setattr(json_numbers, "_written", lambda *args: pytest.fail("read line by line"))
    code, out = _score_jsonl(tmp_path, _jsonl({**row, "w": row["id"] / 2} for row in ROWS))  # 1.0 beside 0.5
    assert code == 0 and [row["w"] for row in out] == [row["id"] / 2 for row in ROWS]
    assert {type(row["w"]) for row in out} == {float}


def test_texts_that_look_like_dates_stay_texts(tmp_path, backends):
    text = ('{"query": "2024-01-01", "document": "2024-01-02T10:00:00Z", "day": "2024-01-03", "n": 1,'
            ' "m": {"at": "2024-01-04 10:00:00", "l": ["2024-01-05"]}}\n'
            '{"query": "2024-01-01", "document": "d", "day": null, "n": 2.5, "m": null}\n')
    code, out = _score_jsonl(tmp_path, text)
    assert code == 0 and out[0] == {"query": "2024-01-01", "document": "2024-01-02T10:00:00Z", "day": "2024-01-03",
                                    "n": 1, "m": {"at": "2024-01-04 10:00:00", "l": ["2024-01-05"]}, "score": 20.0}
    assert list(out[1]) == ["query", "document", "day", "n", "m", "score"] and type(out[0]["n"]) is int


@pytest.mark.parametrize("suffix", [".csv", ".csv.gz"])
def test_a_csv_cell_longer_than_a_read_block_is_read(tmp_path, backends, suffix):
    document = "clause, " * 300000  # 2.4 MB: a row across more than two of pyarrow's 1 MiB read blocks
    text = f'query,document\nq,"{document}"\nq,short\n'.encode()
    source = tmp_path / f"pairs{suffix}"
    source.write_bytes(gzip.compress(text) if suffix.endswith(".gz") else text)
    assert main(["score", "--input", str(source), "--output", str(tmp_path / "out.jsonl"), "--no-progress"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [row["score"] for row in rows] == [len(document), 5.0] and rows[0]["document"] == document


@pytest.mark.parametrize("name, data", [("pairs.jsonl", b""), ("pairs.jsonl", b"\n \r\n\t\n"),
                                        ("pairs.jsonl.gz", gzip.compress(b"")), ("pairs.csv", b""),
                                        ("-", b""), ("-", b"\n\n")],
                         ids=["empty", "blank lines", "empty gzip", "empty csv", "empty stdin", "blank stdin"])
@pytest.mark.parametrize("output", ["out.jsonl", "out.csv", "out.parquet"])
def test_an_empty_shard_scores_no_rows_into_an_empty_output(tmp_path, backends, monkeypatch, capsys, name, data,
                                                            output):
    monkeypatch.chdir(tmp_path)
    if name == "-":
        _stdin(monkeypatch, data)
    else:
        (tmp_path / name).write_bytes(data)
    stdin = ["--format", "jsonl"] if name == "-" else []

    assert main(["score", "--input", name, "--output", output, *stdin, "--no-progress"]) == 0

    assert "scored 0 pairs" in capsys.readouterr().err and backends.made == []  # no model to load for no rows
    if output == "out.parquet":
        table = parquet.read_table(tmp_path / output)
        assert table.num_rows == 0 and table.column_names == ["query", "document", "score"]
    else:
        assert (tmp_path / output).read_text() == ('"query","document","score"\n' if output == "out.csv" else "")
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted({name, output} - {"-"})  # no journal left


@pytest.mark.parametrize("data", [b'{"text": "a"}\n', b"{}\n\n", b"\n[]\n"])
def test_jsonl_rows_without_the_columns_are_still_refused(tmp_path, backends, capsys, data):
    source = tmp_path / "pairs.jsonl"
    source.write_bytes(data)
    assert main(["score", "--input", str(source), "--output", str(tmp_path / "out.jsonl"), "--no-progress"]) == 2
    assert "--input: " in (error := capsys.readouterr().err) and error.count("\n") == 1 and backends.made == []
