"""Offline scoring of a table of (query, document) pairs: what ``rerankit score`` and Ray Data's actors run.

Rows of one query are scored as one request (so a generative model shares the query's prefix among them), several
queries a backend call; the scores come back in row order. Tables are pyarrow tables (the ``ray`` extra brings
pyarrow); their files (Parquet, JSON Lines or CSV, gzipped, or stdin and stdout) are ``table_files``'.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from rerankit.backend import Backend
from rerankit.errors import InvalidRequest
from rerankit.input_paths import check_one_file
from rerankit.schema import ScoreRequest
from rerankit.table_files import (STDIO, check_output, check_writable, read_table, remove_stale_temporaries,
                                  require_pyarrow, table_file, write_table)

CALL_ITEMS = 2048  # pairs a backend call: large enough that data-parallel replicas each get a fair share
REQUEST_ITEMS = 1024  # one query with more rows is scored in runs of this many (a server's usual item limit)


def score_pairs(backend: Backend, queries: Sequence[str], documents: Sequence[str],
                progress: Callable[[int], Any] | None = None, *, scored: dict[int, float] | None = None,
                record: Callable[[list[int], list[float]], Any] | None = None, **request_fields: Any) -> list[float]:
    """The score of each (query, document) row, in row order; ``progress(n)`` is told of each n rows scored.

    ``scored`` (row -> score): rows scored before (a journal's), not scored again; ``record(rows, scores)`` is
    told of each backend call's. ``request_fields`` go to every ``ScoreRequest`` (``instruction``...).
    """
    if len(queries) != len(documents):
        raise InvalidRequest("documents", f"has {len(documents)} rows but queries has {len(queries)}")
    scored = scored or {}
    groups: dict[str, list[int]] = {}
    for row, query in enumerate(queries):
        if row not in scored:
            groups.setdefault(query, []).append(row)
    runs = [(query, rows[start:start + REQUEST_ITEMS])
            for query, rows in groups.items() for start in range(0, len(rows), REQUEST_ITEMS)]
    scores = [scored.get(row, 0.0) for row in range(len(queries))]
    score_batch = getattr(backend, "score_batch", None)
    for call in _calls(runs):
        requests = [ScoreRequest(query=query, items=[documents[row] for row in rows], **request_fields)
                    for query, rows in call]
        responses = score_batch(requests) if score_batch is not None else [backend.score(r) for r in requests]
        for (_, rows), response in zip(call, responses):
            for row, score in zip(rows, response.scores):
                scores[row] = score
        if record is not None:
            rows = [row for _, run in call for row in run]
            record(rows, [scores[row] for row in rows])
        if progress is not None:
            progress(sum(len(rows) for _, rows in call))
    return scores


def _calls(runs: list[tuple[str, list[int]]]) -> list[list[tuple[str, list[int]]]]:
    """Consecutive runs grouped into calls of at most ``CALL_ITEMS`` rows (a larger run alone)."""
    calls: list[list[tuple[str, list[int]]]] = [[]]
    rows = 0
    for run in runs:
        if calls[-1] and rows + len(run[1]) > CALL_ITEMS:
            calls.append([])
            rows = 0
        calls[-1].append(run)
        rows += len(run[1])
    return [call for call in calls if call]


def text_column(table: Any, name: str, flag: str, numbered: bool = True, blank: bool = True) -> list[str]:
    """Column ``name`` as texts: numbers are written as text (a JSONL or Parquet column of them); a cell with no
    value (a JSONL or Parquet null, an absent field) or -- unless ``blank`` -- only whitespace (as a query may not
    be) is an ``InvalidRequest`` naming its column and, where ``numbered`` (the whole table), its row (1-based, as
    an editor counts). An empty text (``""``) where ``blank`` is a text, as the Python API and the server take it."""
    values = table.column(name).to_pylist()
    for row, value in enumerate(values, start=1):
        where = f"row {row}: " if numbered else ""
        if value is None and blank:
            raise InvalidRequest("--input", f'{where}column {name!r} has no value (null or absent; an empty '
                                            f'text is written ""); {flag} names the column')
        if value is None or (not blank and isinstance(value, str) and not value.strip()):
            raise InvalidRequest("--input", f"{where}column {name!r} is empty ({flag} names the column)")
        if not isinstance(value, str):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidRequest("--input", f"{where}column {name!r} holds {type(value).__name__} "
                                                f"{str(value)[:40]!r}, not text")
            values[row - 1] = str(value)
    return values


def with_scores(table: Any, scores: Sequence[float], column: str = "score") -> Any:
    """``table`` with a float64 ``column`` of ``scores`` appended (replacing one of that name)."""
    pyarrow = require_pyarrow()
    if column in table.column_names:
        table = table.drop_columns([column])
    return table.append_column(column, pyarrow.array(scores, type=pyarrow.float64()))


def offline_backend(model: str | Sequence[str] | None, **engine_options: Any) -> Backend:
    """``make_backend(model, **engine_options)`` for scoring a table: a local engine draws no progress bar of its
    own (the caller counts rows); a server URL gives a remote client."""
    from rerankit.reranker import is_url, make_backend

    return make_backend(model, **(engine_options if is_url(model) else {"show_progress": False, **engine_options}))


def score_file(input_path: str | Path, output_path: str | Path, *, model: str | None = None,
               query_column: str = "query", document_column: str = "document", score_column: str = "score",
               show_progress: bool = True, request_fields: dict[str, Any] | None = None,
               file_format: str | None = None, **engine_options: Any) -> int:
    """Score the pairs of ``input_path`` with ``offline_backend(model, **engine_options)`` (here, or on the server
    a URL names) and write them with a ``score_column`` to ``output_path``; returns the number of rows. Either may
    be ``-`` (stdin, stdout) in ``file_format``; stdout without it takes the input's format.

    Each backend call's scores are kept in a journal beside the output (``score_journal``) until it is written: a
    run stopped for any reason (Ctrl-C, a lost server) goes on where it stopped when run again. Stdout has no
    journal (nowhere beside it); stdin's is known by the texts scored, as it is read whole before scoring."""
    from tqdm.auto import tqdm

    from rerankit.score_journal import ScoreJournal, job_of, journal_path

    if file_format is not None and STDIO not in (str(input_path), str(output_path)):
        raise InvalidRequest("--format", "only applies to - as --input or --output (a file's format is its suffix)")
    check_one_file(str(input_path))  # a folder or a glob: --ray reads them
    source = table_file(input_path, "--input", file_format)
    target = check_output(output_path, file_format or source.format)
    if score_column in (query_column, document_column):
        raise InvalidRequest("--score-column", f"{score_column!r} is the query or document column: the scores "
                                               "would replace its texts")
    table = read_table(input_path, (query_column, document_column), source.format)
    check_writable(with_scores(table.slice(0, 0), [], score_column), output_path, target.format)
    queries = text_column(table, query_column, "--query-column", blank=False)
    documents = text_column(table, document_column, "--document-column")
    journal = None
    if not target.stdio:
        job = job_of(input_path, queries, documents, model, columns=[query_column, document_column],
                     fields=request_fields or {}, engine={name: value for name, value in engine_options.items()
                                                          if name not in ("data_parallel_size", "show_progress")})
        try:
            journal = ScoreJournal(journal_path(output_path), job, table.num_rows)
        except OSError as exc:
            raise InvalidRequest("--output", f"cannot keep scores beside {output_path}: {exc}") from None
    scored = journal.scored if journal is not None else {}
    left = table.num_rows - len(scored)
    backend = offline_backend(model, **engine_options) if left else None  # every row journaled: no model to load
    try:
        with tqdm(total=table.num_rows, unit="pair", desc="rerankit score", disable=not show_progress,
                  initial=len(scored), file=sys.stderr) as bar:
            if scored:
                bar.write(f"rerankit score: {len(scored) if left else 'all'} of {table.num_rows} rows were scored by "
                          f"an earlier run ({journal.path}); " + ("scoring the rest" if left else "writing them"),
                          file=sys.stderr)
            scores = score_pairs(backend, queries, documents, bar.update, scored=scored,
                                 record=journal.record if journal is not None else None, **(request_fields or {}))
    except BaseException:
        if journal is not None and journal.kept:
            journal.close()
            print(f"rerankit score: the {journal.kept} rows scored so far are kept in {journal.path}: run the same "
                  "command again to go on", file=sys.stderr)
        elif journal is not None:
            journal.remove()
        raise
    finally:
        if backend is not None:
            backend.close()
    if not target.stdio:
        remove_stale_temporaries(output_path)  # the journal's lock, held here, keeps any live run of it away
    write_table(with_scores(table, scores, score_column), output_path, target.format)
    if journal is not None:
        journal.remove()
    return table.num_rows
