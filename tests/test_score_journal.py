"""``rerankit score`` keeps each call's scores in a journal beside the output: a run stopped by Ctrl-C or a lost
backend goes on where it stopped, scores nothing twice, and writes what an uninterrupted run writes."""

from __future__ import annotations

import json

import pytest

pyarrow = pytest.importorskip("pyarrow")
import pyarrow.parquet as parquet  # noqa: E402

from rerankit import offline  # noqa: E402
from rerankit.cli import main  # noqa: E402
from rerankit.errors import RemoteError  # noqa: E402
from rerankit.score_journal import journal_path  # noqa: E402

ROWS = [{"id": row, "q": f"query {row % 10} about paris", "text": f"document {row} on the capital of france"}
        for row in range(30)]


class Counting:
    """A backend that scores through ``backend`` and counts the rows it was asked for; raises ``failure`` on the
    call after ``calls`` calls."""

    def __init__(self, backend, calls=None, failure=None):
        self.backend, self.calls, self.failure, self.rows = backend, calls, failure, 0

    def score_batch(self, requests):
        if self.calls is not None and self.calls == 0:
            raise self.failure
        if self.calls is not None:
            self.calls -= 1
        self.rows += sum(len(request.items) for request in requests)
        return self.backend.score_batch(requests)

    def close(self):
        self.backend.close()


@pytest.fixture
def pairs(tmp_path, tiny_bert_cross_encoder, monkeypatch):
    """The input file, the output path and a ``run(backend_wrapper)`` of ``rerankit score`` on them."""
    source, target = tmp_path / "pairs.parquet", tmp_path / "scored.jsonl"
    parquet.write_table(pyarrow.Table.from_pylist(ROWS), source)
    monkeypatch.setattr(offline, "CALL_ITEMS", 4)  # calls of a few rows: several calls a run
    made = offline.offline_backend
    used = []

    def run(wrap=lambda backend: Counting(backend)):
        monkeypatch.setattr(offline, "offline_backend", lambda *a, **k: used.append(wrap(made(*a, **k))) or used[-1])
        return main(["score", "--input", str(source), "--output", str(target), "--model", str(tiny_bert_cross_encoder),
                     "--device", "cpu", "--query-column", "q", "--document-column", "text", "--no-progress"])

    return source, target, run, used


@pytest.mark.parametrize("failure, code", [(KeyboardInterrupt(), 130), (RemoteError("the server went away"), 2)],
                         ids=["ctrl-c", "lost server"])
def test_a_stopped_run_goes_on_where_it_stopped(pairs, capsys, failure, code):
    source, target, run, used = pairs
    assert run() == 0
    expected = target.read_text()
    target.unlink()

    assert run(lambda backend: Counting(backend, calls=3, failure=failure)) == code
    err = capsys.readouterr().err
    journal = journal_path(target)
    assert "rows scored so far are kept in" in err and journal.exists() and not target.exists()
    first = used[-1].rows
    assert 0 < first < len(ROWS)

    assert run() == 0
    assert used[-1].rows == len(ROWS) - first  # nothing scored twice
    assert f"{first} of {len(ROWS)} rows were scored by an earlier run" in capsys.readouterr().err
    assert target.read_text() == expected and not journal.exists()


def test_a_journal_of_another_input_is_not_taken(pairs):
    source, target, run, used = pairs
    assert run(lambda backend: Counting(backend, calls=2, failure=KeyboardInterrupt())) == 130
    parquet.write_table(pyarrow.Table.from_pylist(ROWS[:20]), source)  # the input changed
    assert run() == 0
    assert used[-1].rows == 20
    assert [json.loads(line)["id"] for line in target.read_text().splitlines()] == list(range(20))


def test_a_line_cut_short_is_scored_again(pairs):
    source, target, run, used = pairs
    assert run(lambda backend: Counting(backend, calls=3, failure=KeyboardInterrupt())) == 130
    journal = journal_path(target)
    lines = journal.read_text().splitlines(keepends=True)
    last = json.loads(lines[-1])
    journal.write_text("".join(lines[:-1]) + lines[-1][:len(lines[-1]) // 2])  # killed while writing it
    kept = used[-1].rows - len(last["rows"])
    assert run() == 0
    assert used[-1].rows == len(ROWS) - kept


def test_a_run_that_scored_nothing_leaves_no_journal(pairs, capsys):
    source, target, run, used = pairs
    assert run(lambda backend: Counting(backend, calls=0, failure=KeyboardInterrupt())) == 130
    assert "kept in" not in capsys.readouterr().err
    assert not journal_path(target).exists()
