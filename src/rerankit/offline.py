"""Offline scoring of a table of (query, document) pairs: what ``rerankit score`` and Ray Data's actors run.

Rows of one query are scored as one request (so a generative model shares the query's prefix among them), several
queries a backend call; the scores come back in row order. Tables are pyarrow tables (the ``ray`` extra brings
pyarrow); files are Parquet, JSON Lines or CSV, by suffix.
"""

from __future__ import annotations

import glob
import math
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

from rerankit.backend import Backend
from rerankit.errors import InvalidRequest, RerankitError
from rerankit.schema import ScoreRequest

CALL_ITEMS = 2048  # pairs a backend call: large enough that data-parallel replicas each get a fair share
REQUEST_ITEMS = 1024  # one query with more rows is scored in runs of this many (a server's usual item limit)
SUFFIXES = (".parquet", ".jsonl", ".csv")


def require_pyarrow() -> Any:
    """The ``pyarrow`` module, or a ``RerankitError`` naming the pip command."""
    try:
        import pyarrow
    except ImportError:
        raise RerankitError("reading and writing tables needs pyarrow: pip install 'rerankit[ray]'") from None
    return pyarrow


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


def read_table(path: str | Path, columns: Sequence[str]) -> Any:
    """The pyarrow table of a .parquet, .jsonl or .csv file; ``InvalidRequest`` naming ``--input`` if it cannot
    be read or lacks one of ``columns``."""
    pyarrow = require_pyarrow()
    path = Path(path)
    if path.suffix.lower() not in SUFFIXES:
        raise InvalidRequest("--input", f"{path} must end in one of {', '.join(SUFFIXES)}")
    try:
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as parquet

            table = parquet.read_table(path)
        elif path.suffix.lower() == ".jsonl":
            table = _read_jsonl(path)
        else:
            table = _read_csv(path, columns)
    except (OSError, pyarrow.ArrowInvalid) as exc:
        raise InvalidRequest("--input", f"cannot read {path}: {exc}") from None
    missing = [name for name in columns if name not in table.column_names]
    if missing:
        raise InvalidRequest("--input", f"{path} has no column {missing[0]!r} (its columns: "
                                        f"{', '.join(table.column_names)}); choose one with --query-column / "
                                        "--document-column")
    doubled = [name for name in columns if table.column_names.count(name) > 1]
    if doubled:
        raise InvalidRequest("--input", f"{path} has {table.column_names.count(doubled[0])} columns named "
                                        f"{doubled[0]!r}: rename them")
    return table


def _read_jsonl(path: Path) -> Any:
    """A JSON Lines file; a line longer than pyarrow's 1 MiB block (a multi-megabyte document) is read with one
    block for the whole file instead of being refused as a "straddling object"."""
    import pyarrow
    import pyarrow.json as json

    try:
        return json.read_json(path)
    except pyarrow.ArrowInvalid as exc:
        if "straddl" not in str(exc):
            raise
    block = min(max(path.stat().st_size + 1, 1 << 20), (1 << 31) - 1)
    return json.read_json(path, read_options=json.ReadOptions(block_size=block))


def _read_csv(path: Path, text_columns: Sequence[str]) -> Any:
    """A CSV file, its cells kept as written: the text columns as strings (a column of numbers, "2024", is text
    to score), quoted values may hold newlines, and any other column is typed (int, float, bool, date) only where
    every cell reads back as the same text -- an id "00123", "1e5" or "N/A" stays as written."""
    import pyarrow
    import pyarrow.compute as compute
    import pyarrow.csv as csv

    parse = csv.ParseOptions(newlines_in_values=True)
    names = csv.open_csv(path, parse_options=parse).schema.names
    as_text = csv.read_csv(path, parse_options=parse, convert_options=csv.ConvertOptions(
        column_types={name: pyarrow.string() for name in names}))
    typed = csv.read_csv(path, parse_options=parse, convert_options=csv.ConvertOptions(
        column_types={name: pyarrow.string() for name in text_columns}))
    if len(set(names)) != len(names):
        return as_text  # columns are matched by name below
    for position, name in enumerate(names):
        column = typed.column(name)
        if pyarrow.types.is_string(column.type):
            continue
        # a typed cell must read back as its text; a null one (an empty cell) only where the cell is empty
        same = compute.equal(compute.cast(column, pyarrow.string()).fill_null(""), as_text.column(name))
        if compute.all(same).as_py() is not False:
            as_text = as_text.set_column(position, name, column)
    return as_text


def check_output(path: str | Path) -> Path:
    """``path`` as a table can be written there: a known suffix and a folder this process can create a file in;
    ``InvalidRequest`` naming ``--output`` otherwise (checked before any row is scored)."""
    path = Path(path)
    if path.suffix.lower() not in SUFFIXES:
        raise InvalidRequest("--output", f"{path} must end in one of {', '.join(SUFFIXES)}")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise InvalidRequest("--output", f"{path}: the folder {folder} does not exist")
    if path.is_dir():
        raise InvalidRequest("--output", f"{path} is a folder, not a file")
    try:  # the file is written as a temporary one beside it, then renamed: that must work before hours of scoring
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{path.name}.", suffix=".tmp"):
            pass
    except OSError as exc:
        raise InvalidRequest("--output", f"cannot write into {folder}: {exc.strerror or exc}") from None
    return path


def check_writable(table: Any, path: str | Path) -> None:
    """``InvalidRequest`` naming ``--output`` when ``table``'s columns cannot be written in ``path``'s format
    (a struct or list column as CSV), checked on its empty slice before any row is scored."""
    import io

    pyarrow = require_pyarrow()
    if Path(path).suffix.lower() != ".csv":
        return
    import pyarrow.csv as csv

    try:
        csv.write_csv(table.slice(0, 0), io.BytesIO())
    except (pyarrow.ArrowInvalid, pyarrow.ArrowNotImplementedError) as exc:
        raise InvalidRequest("--output", f"{path}: CSV cannot hold these columns ({exc}); write .jsonl or "
                                         ".parquet") from None


def text_column(table: Any, name: str, flag: str, numbered: bool = True, blank: bool = True) -> list[str]:
    """Column ``name`` as texts: numbers are written as text (a JSONL or Parquet column of them); an empty cell
    (null, missing, or -- unless ``blank`` -- only whitespace, as a query may not be) is an ``InvalidRequest``
    naming its column and, where ``numbered`` (the whole table), its row (1-based, as an editor counts)."""
    values = table.column(name).to_pylist()
    for row, value in enumerate(values, start=1):
        where = f"row {row}: " if numbered else ""
        if value is None or (not blank and isinstance(value, str) and not value.strip()):
            raise InvalidRequest("--input", f"{where}column {name!r} is empty ({flag} names the column)")
        if not isinstance(value, str):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidRequest("--input", f"{where}column {name!r} holds {type(value).__name__} "
                                                f"{str(value)[:40]!r}, not text")
            values[row - 1] = str(value)
    return values


def write_table(table: Any, path: str | Path) -> None:
    """Write ``table`` as .parquet, .jsonl or .csv, by ``path``'s suffix: into a temporary file beside it, renamed
    over ``path`` once whole, so an existing file is never left truncated; ``InvalidRequest`` naming ``--output``
    if it cannot be written."""
    pyarrow = require_pyarrow()
    path = check_output(path)
    # a name of its own beside the target, created as any new file is (the umask's mode), then renamed over it
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        temporary.open("xb").close()
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as parquet

            parquet.write_table(table, temporary)
        elif path.suffix.lower() == ".csv":
            import pyarrow.csv as csv

            csv.write_csv(table, temporary)
        else:
            import json

            with temporary.open("w", encoding="utf-8") as out:
                for row in table.to_pylist():
                    out.write(json.dumps(_json_safe(row), ensure_ascii=False, default=str, allow_nan=False) + "\n")
        if path.exists():  # the file replaced keeps its mode
            os.chmod(temporary, path.stat().st_mode & 0o7777)
        os.replace(temporary, path)
    except (OSError, pyarrow.ArrowInvalid, pyarrow.ArrowNotImplementedError) as exc:
        raise InvalidRequest("--output", f"cannot write {path}: {exc}") from None
    finally:
        temporary.unlink(missing_ok=True)


def _json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as null (JSON has no such numbers: ``NaN`` would make the line invalid)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    return value


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
               **engine_options: Any) -> int:
    """Score the pairs of ``input_path`` with ``offline_backend(model, **engine_options)`` (here, or on the server
    a URL names) and write them with a ``score_column`` to ``output_path``; returns the number of rows.

    Each backend call's scores are kept in a journal beside the output (``score_journal``) until it is written: a
    run stopped for any reason (Ctrl-C, a lost server) goes on where it stopped when run again."""
    from tqdm.auto import tqdm

    from rerankit.score_journal import ScoreJournal, job_of, journal_path

    check_output(output_path)
    if score_column in (query_column, document_column):
        raise InvalidRequest("--score-column", f"{score_column!r} is the query or document column: the scores "
                                               "would replace its texts")
    table = read_table(input_path, (query_column, document_column))
    check_writable(with_scores(table.slice(0, 0), [], score_column), output_path)
    queries = text_column(table, query_column, "--query-column", blank=False)
    documents = text_column(table, document_column, "--document-column")
    job = job_of(input_path, queries, documents, model, columns=[query_column, document_column],
                 fields=request_fields or {}, engine={name: value for name, value in engine_options.items()
                                                      if name not in ("data_parallel_size", "show_progress")})
    try:
        journal = ScoreJournal(journal_path(output_path), job, table.num_rows)
    except OSError as exc:
        raise InvalidRequest("--output", f"cannot keep scores beside {output_path}: {exc}") from None
    backend = offline_backend(model, **engine_options)
    try:
        with tqdm(total=table.num_rows, unit="pair", desc="rerankit score", disable=not show_progress,
                  initial=len(journal.scored)) as bar:
            if journal.scored:
                bar.write(f"rerankit score: {len(journal.scored)} of {table.num_rows} rows were scored by an "
                          f"earlier run ({journal.path}); scoring the rest", file=sys.stderr)
            scores = score_pairs(backend, queries, documents, bar.update, scored=journal.scored,
                                 record=journal.record, **(request_fields or {}))
    except BaseException:
        if journal.kept:
            journal.close()
            print(f"rerankit score: the {journal.kept} rows scored so far are kept in {journal.path}: run the same "
                  "command again to go on", file=sys.stderr)
        else:
            journal.remove()
        raise
    finally:
        backend.close()
    output = Path(output_path)
    for stale in output.parent.glob(f".{glob.escape(output.name)}.*.tmp"):  # of runs killed while writing: the
        stale.unlink(missing_ok=True)  # journal's lock, held here, keeps any live run of this output away
    write_table(with_scores(table, scores, score_column), output_path)
    journal.remove()
    return table.num_rows
