"""Offline scoring of a table of (query, document) pairs: what ``rerankit score`` and Ray Data's actors run.

Rows of one query are scored as one request (so a generative model shares the query's prefix among them), several
queries a backend call; the scores come back in row order. Tables are pyarrow tables (the ``ray`` extra brings
pyarrow); files are Parquet, JSON Lines or CSV, by suffix.
"""

from __future__ import annotations

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
                progress: Callable[[int], Any] | None = None, **request_fields: Any) -> list[float]:
    """The score of each (query, document) row, in row order; ``progress(n)`` is told of each n rows scored.

    ``request_fields`` go to every ``ScoreRequest`` (``instruction``, ``max_tokens_per_item``...).
    """
    if len(queries) != len(documents):
        raise InvalidRequest("documents", f"has {len(documents)} rows but queries has {len(queries)}")
    groups: dict[str, list[int]] = {}
    for row, query in enumerate(queries):
        groups.setdefault(query, []).append(row)
    runs = [(query, rows[start:start + REQUEST_ITEMS])
            for query, rows in groups.items() for start in range(0, len(rows), REQUEST_ITEMS)]
    scores = [0.0] * len(queries)
    score_batch = getattr(backend, "score_batch", None)
    for call in _calls(runs):
        requests = [ScoreRequest(query=query, items=[documents[row] for row in rows], **request_fields)
                    for query, rows in call]
        responses = score_batch(requests) if score_batch is not None else [backend.score(r) for r in requests]
        for (_, rows), response in zip(call, responses):
            for row, score in zip(rows, response.scores):
                scores[row] = score
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
    if path.suffix not in SUFFIXES:
        raise InvalidRequest("--input", f"{path} must end in one of {', '.join(SUFFIXES)}")
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as parquet

            table = parquet.read_table(path)
        elif path.suffix == ".jsonl":
            import pyarrow.json as json

            table = json.read_json(path)
        else:
            import pyarrow.csv as csv

            # the text columns as strings: a column of numbers ("2024", "42") is text to score, not int64
            table = csv.read_csv(path, convert_options=csv.ConvertOptions(
                column_types={name: pyarrow.string() for name in columns}))
    except (OSError, pyarrow.ArrowInvalid) as exc:
        raise InvalidRequest("--input", f"cannot read {path}: {exc}") from None
    missing = [name for name in columns if name not in table.column_names]
    if missing:
        raise InvalidRequest("--input", f"{path} has no column {missing[0]!r} (its columns: "
                                        f"{', '.join(table.column_names)}); choose one with --query-column / "
                                        "--document-column")
    return table


def check_output(path: str | Path) -> Path:
    """``path`` as a table can be written there: a known suffix and an existing folder; ``InvalidRequest`` naming
    ``--output`` otherwise (checked before any row is scored)."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise InvalidRequest("--output", f"{path} must end in one of {', '.join(SUFFIXES)}")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise InvalidRequest("--output", f"{path}: the folder {folder} does not exist")
    if path.is_dir():
        raise InvalidRequest("--output", f"{path} is a folder, not a file")
    return path


def text_column(table: Any, name: str, flag: str, numbered: bool = True) -> list[str]:
    """Column ``name`` as texts: numbers are written as text (a JSONL or Parquet column of them); an empty cell
    (null, missing) is an ``InvalidRequest`` naming its column and, where ``numbered`` (the whole table), its row
    (1-based, as an editor counts)."""
    values = table.column(name).to_pylist()
    for row, value in enumerate(values, start=1):
        where = f"row {row}: " if numbered else ""
        if value is None:
            raise InvalidRequest("--input", f"{where}column {name!r} is empty ({flag} names the column)")
        if not isinstance(value, str):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidRequest("--input", f"{where}column {name!r} holds {type(value).__name__} "
                                                f"{str(value)[:40]!r}, not text")
            values[row - 1] = str(value)
    return values


def write_table(table: Any, path: str | Path) -> None:
    """Write ``table`` as .parquet, .jsonl or .csv, by ``path``'s suffix."""
    path = check_output(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as parquet

        parquet.write_table(table, path)
    elif path.suffix == ".csv":
        import pyarrow.csv as csv

        csv.write_csv(table, path)
    else:
        import json

        with path.open("w", encoding="utf-8") as out:
            for row in table.to_pylist():
                out.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")


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
    a URL names) and write them with a ``score_column`` to ``output_path``; returns the number of rows."""
    from tqdm.auto import tqdm

    check_output(output_path)
    table = read_table(input_path, (query_column, document_column))
    queries = text_column(table, query_column, "--query-column")
    documents = text_column(table, document_column, "--document-column")
    backend = offline_backend(model, **engine_options)
    try:
        with tqdm(total=table.num_rows, unit="pair", desc="rerankit score", disable=not show_progress) as bar:
            scores = score_pairs(backend, queries, documents, bar.update, **(request_fields or {}))
    finally:
        backend.close()
    write_table(with_scores(table, scores, score_column), output_path)
    return table.num_rows
