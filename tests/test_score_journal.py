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


def test_a_run_whose_rows_were_all_scored_before_loads_no_model(pairs, capsys, monkeypatch):
    source, target, run, used = pairs
    assert run() == 0
    expected = target.read_text()
    target.unlink()
    write = offline.write_table
    monkeypatch.setattr(offline, "write_table", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert run() == 130  # stopped while writing: every row is in the journal
    monkeypatch.setattr(offline, "write_table", write)
    loaded = len(used)

    assert run() == 0
    assert len(used) == loaded  # no model loaded to score nothing
    assert f"all of {len(ROWS)} rows were scored by an earlier run" in capsys.readouterr().err
    assert target.read_text() == expected and not journal_path(target).exists()


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


def test_lines_after_a_cut_line_are_kept_by_the_next_runs(pairs):
    """A cut last line is cut off before the next run appends: that run's scores are taken by the run after it
    (they were glued onto the cut line, unreadable, and every later run started from the same rows)."""
    source, target, run, used = pairs
    assert run(lambda backend: Counting(backend, calls=3, failure=KeyboardInterrupt())) == 130
    journal = journal_path(target)
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:-1]) + lines[-1][:len(lines[-1]) // 2])  # killed while writing it
    kept = used[-1].rows - len(json.loads(lines[-1])["rows"])
    assert run(lambda backend: Counting(backend, calls=2, failure=KeyboardInterrupt())) == 130
    kept += used[-1].rows
    assert run() == 0
    assert used[-1].rows == len(ROWS) - kept  # nothing the second run scored is scored again


def test_a_full_disk_keeps_the_journal_whole(pairs, capsys):
    """The disk fills while a line is written: an error line (not a traceback), no part of the line left, and the
    next run takes every whole line."""
    import resource

    source, target, run, used = pairs
    assert run(lambda backend: Counting(backend, calls=2, failure=KeyboardInterrupt())) == 130
    journal = journal_path(target)
    lines = journal.read_text().splitlines(keepends=True)
    kept = used[-1].rows
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (journal.stat().st_size + len(lines[-1]) // 2, hard))
    try:  # writes past the limit are cut short, then fail with EFBIG, as on a full disk (ENOSPC)
        code = run()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert code == 2 and "cannot keep scores in" in capsys.readouterr().err
    assert journal.read_bytes().endswith(b"\n") and not target.exists()
    assert run() == 0
    assert used[-1].rows == len(ROWS) - kept


def test_a_second_run_of_the_same_command_is_refused(pairs, capsys):
    """A run whose journal another run holds is refused: it neither truncates nor removes that journal."""
    from rerankit.score_journal import ScoreJournal

    source, target, run, used = pairs
    assert run(lambda backend: Counting(backend, calls=2, failure=KeyboardInterrupt())) == 130
    journal = journal_path(target)
    before = journal.read_bytes()
    job = json.loads(before.splitlines()[0])
    holder = ScoreJournal(journal, job, len(ROWS))  # the other run, still going
    try:
        assert run(lambda backend: Counting(backend, calls=0, failure=KeyboardInterrupt())) == 2
        assert "another rerankit score" in capsys.readouterr().err
        assert journal.read_bytes() == before
    finally:
        holder.close()


def test_a_model_saved_over_its_folder_starts_afresh(tmp_path, monkeypatch):
    """The journal of a model folder whose files were replaced (a new checkpoint at the same path) is not taken."""
    from tiny_models import make_bert_cross_encoder

    model = make_bert_cross_encoder(tmp_path / "model", seed=2)
    source, target = tmp_path / "pairs.parquet", tmp_path / "scored.jsonl"
    parquet.write_table(pyarrow.Table.from_pylist(ROWS), source)
    monkeypatch.setattr(offline, "CALL_ITEMS", 4)
    made, used = offline.offline_backend, []
    args = ["score", "--input", str(source), "--output", str(target), "--model", str(model), "--device", "cpu",
            "--query-column", "q", "--document-column", "text", "--no-progress"]

    def run(wrap):
        monkeypatch.setattr(offline, "offline_backend", lambda *a, **k: used.append(wrap(made(*a, **k))) or used[-1])
        return main(args)

    assert run(lambda backend: Counting(backend, calls=2, failure=KeyboardInterrupt())) == 130
    make_bert_cross_encoder(tmp_path / "model", seed=7)  # retrained, saved over it
    assert run(Counting) == 0
    assert used[-1].rows == len(ROWS)


def test_an_input_replaced_keeping_size_and_time_starts_afresh(tmp_path, tiny_bert_cross_encoder, monkeypatch):
    """Another input of the same size and modification time (two rows' texts swapped, copied with cp -p) is
    another job: its rows do not take the scores of the rows that were at their place."""
    import os

    source, target = tmp_path / "pairs.csv", tmp_path / "scored.jsonl"
    texts = [row["text"] for row in ROWS]
    write = lambda: source.write_text("q,text\n" + "".join(f"{row['q']},{text}\n" for row, text in zip(ROWS, texts)))
    write()
    monkeypatch.setattr(offline, "CALL_ITEMS", 4)
    made, used = offline.offline_backend, []

    def run(wrap):
        monkeypatch.setattr(offline, "offline_backend", lambda *a, **k: used.append(wrap(made(*a, **k))) or used[-1])
        return main(["score", "--input", str(source), "--output", str(target), "--model", str(tiny_bert_cross_encoder),
                     "--device", "cpu", "--query-column", "q", "--document-column", "text", "--no-progress"])

    assert run(lambda backend: Counting(backend, calls=3, failure=KeyboardInterrupt())) == 130
    stat = source.stat()
    texts[0], texts[1] = texts[1], texts[0]
    write()
    assert source.stat().st_size == stat.st_size
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert run(Counting) == 0
    assert used[-1].rows == len(ROWS)


def test_temporary_outputs_of_killed_runs_are_removed(pairs):
    """A run killed while writing its output leaves a hidden temporary file beside it; the next run removes it."""
    source, target, run, used = pairs
    stale = target.with_name(f".{target.name}.12345.0123456789ab.tmp")
    stale.write_bytes(b"x" * 1000)
    other = target.with_name(".other.jsonl.12345.0123456789ab.tmp")
    other.write_bytes(b"y")
    assert run() == 0
    assert not stale.exists() and other.exists()
