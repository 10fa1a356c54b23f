"""The files of ``rerankit score``: a table read from and written to .parquet, .jsonl or .csv (the last two also
gzipped, .jsonl.gz and .csv.gz), or stdin and stdout as ``-`` in a format named apart (``--format``).

Cells come back as written: a CSV cell keeps its text, a JSONL number written as an int stays an int where pyarrow
would make a column of ints and floats all floats (``json_numbers``). A file is written whole or not at all (a
temporary file renamed over the target); stdout is written once every row is scored.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import math
import os
import re
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from rerankit.csv_cells import header_names, read_cells
from rerankit.errors import InvalidRequest, RerankitError
from rerankit.json_numbers import JSON_NUMBERS, JSON_VALUES, keep_written, marked, pyarrow_typed

STDIO = "-"
FORMATS = ("parquet", "jsonl", "csv")
SUFFIXES = (".parquet", ".jsonl", ".csv", ".jsonl.gz", ".csv.gz")
BATCH_ROWS = 4096  # JSONL rows turned into Python objects at a time while writing


def require_pyarrow() -> Any:
    """The ``pyarrow`` module, or a ``RerankitError`` naming the pip command."""
    try:
        import pyarrow
    except ImportError:
        raise RerankitError("reading and writing tables needs pyarrow: pip install 'rerankit[ray]'") from None
    return pyarrow


@dataclass(frozen=True)
class TableFile:
    """A file (or ``-``: stdin or stdout) and its format; ``flag`` names it in errors."""

    path: str
    format: str
    gzipped: bool
    flag: str

    @property
    def stdio(self) -> bool:
        return self.path == STDIO

    @property
    def name(self) -> str:
        """The file, as an error names it."""
        return ("stdin" if self.flag == "--input" else "stdout") if self.stdio else self.path


def table_file(path: str | Path, flag: str, file_format: str | None = None) -> TableFile:
    """``path`` with its format: its suffix's (``.gz`` after it: gzipped), or ``file_format`` for ``-``;
    ``InvalidRequest`` naming ``flag`` for an unknown suffix or a ``-`` without a format."""
    path = str(path)
    if path == STDIO:
        if file_format not in FORMATS:
            raise InvalidRequest(flag, "- has no suffix to tell its format: give --format jsonl, csv or parquet")
        return TableFile(path, file_format, False, flag)
    lowered = path.lower()
    gzipped = lowered.endswith(".gz")
    stem = lowered[:-3] if gzipped else lowered
    found = next((name for name in FORMATS if stem.endswith(f".{name}")), None)
    if found is None or (gzipped and found == "parquet"):
        why = " (Parquet compresses its own pages: drop the .gz)" if found == "parquet" else ""
        raise InvalidRequest(flag, f"{path} must end in one of {', '.join(SUFFIXES)}{why}")
    return TableFile(path, found, gzipped, flag)


def read_table(path: str | Path, columns: Sequence[str], file_format: str | None = None) -> Any:
    """The pyarrow table of a .parquet, .jsonl or .csv file (gzipped, or stdin as ``-`` in ``file_format``);
    ``InvalidRequest`` naming ``--input`` if it cannot be read or lacks one of ``columns``."""
    pyarrow = require_pyarrow()
    source = table_file(path, "--input", file_format)
    gzipped = source.gzipped
    try:
        open_stream, gzipped = _opener(source)
        if source.format == "parquet":
            import pyarrow.parquet as parquet

            with open_stream() as stream:
                table = parquet.read_table(stream)
        elif source.format == "jsonl":
            table = _unless_blank(lambda: _read_jsonl(open_stream, source), open_stream, columns)
        else:
            table = _unless_blank(lambda: _read_csv(open_stream, columns, source), open_stream, columns)
        _check_text(table, source)
        if source.format == "jsonl":
            table = keep_written(table, open_stream, columns)
    except UnicodeDecodeError:  # pyarrow decodes the column names as it hands them out
        raise InvalidRequest("--input", f"cannot read {source.name}: a column name is not UTF-8 text (save the "
                                        "file as UTF-8)") from None
    except (OSError, pyarrow.ArrowInvalid) as exc:
        damaged = gzipped and any(word in str(exc).lower() for word in ("compress", "zlib", "gzip"))
        why = ""
        if damaged and "header" in str(exc) and not source.stdio:
            why = " (it is not gzip, though its name ends in .gz)"
        elif damaged:
            why = f" (the gzip {'data on stdin' if source.stdio else 'file'} is cut short or damaged)"
        raise InvalidRequest("--input", f"cannot read {source.name}: {exc}{why}") from None
    missing = [name for name in columns if name not in table.column_names]
    if missing:
        raise InvalidRequest("--input", f"{source.name} has no column {missing[0]!r} (its columns: "
                                        f"{', '.join(table.column_names)}); choose one with --query-column / "
                                        "--document-column")
    doubled = [name for name in columns if table.column_names.count(name) > 1]
    if doubled:
        raise InvalidRequest("--input", f"{source.name} has {table.column_names.count(doubled[0])} columns named "
                                        f"{doubled[0]!r}: rename them")
    return table


def _opener(source: TableFile) -> tuple[Callable[[], Any], bool]:
    """A function giving a new pyarrow stream of ``source``'s bytes, decompressed (a truncated or corrupt gzip
    raises ``OSError`` as it is read), and whether they are gzipped; stdin is read whole once, each stream reads it
    again from memory (decompressed as it is read where it is gzip: no ``gzip -dc`` is needed in the pipe)."""
    import pyarrow

    if source.stdio and sys.stdin is None:
        raise InvalidRequest("--input", "stdin is closed: name a file, or pipe the pairs in")
    if source.stdio:
        data = pyarrow.py_buffer(sys.stdin.buffer.read())
        if source.format != "parquet" and data[:2] == b"\x1f\x8b":  # JSON and CSV text never begin so
            return lambda: pyarrow.CompressedInputStream(pyarrow.BufferReader(data), "gzip"), True
        return lambda: pyarrow.BufferReader(data), False
    return lambda: pyarrow.input_stream(source.path, compression="gzip" if source.gzipped else None), source.gzipped


def _unless_blank(read: Callable[[], Any], open_stream: Callable[[], Any], columns: Sequence[str]) -> Any:
    """``read()``'s table, or -- where the JSONL or CSV text is empty or only blank lines (an empty shard; pyarrow
    finds no rows, or refuses an "Empty ... file") -- a table of no rows with ``columns`` as texts, as a CSV file of
    only its header gives. A file with rows is ``read()``'s as it is, lacking a column or not."""
    import pyarrow

    try:
        table = read()
    except pyarrow.ArrowInvalid:
        if not _blank(open_stream):
            raise
        table = None
    if table is not None and (table.num_rows or table.num_columns or not _blank(open_stream)):
        return table
    return empty_texts(columns)


def empty_texts(columns: Sequence[str]) -> Any:
    """A table of no rows with ``columns`` as texts: what an empty JSONL or CSV file reads as."""
    import pyarrow

    return pyarrow.table({name: pyarrow.array([], pyarrow.string()) for name in dict.fromkeys(columns)})


def _blank(open_stream: Callable[[], Any]) -> bool:
    """Whether ``open_stream()`` gives only whitespace (or nothing); False where it cannot be read."""
    try:
        with open_stream() as stream:
            while chunk := stream.read(1 << 20):
                if chunk.strip():
                    return False
    except OSError:
        return False
    return True


def _check_text(table: Any, source: TableFile) -> None:
    """``InvalidRequest`` naming ``--input`` and the column where a text of ``table`` is not UTF-8 (pyarrow reads
    JSON text as it is; it would fail when the rows are scored or written)."""
    import pyarrow

    for name, column in zip(table.column_names, table.columns):
        try:
            column.validate(full=True)
        except pyarrow.ArrowInvalid:
            raise InvalidRequest("--input", f"cannot read {source.name}: column {name!r} holds text that is not "
                                            "UTF-8 (save the file as UTF-8)") from None


def _read_jsonl(open_stream: Callable[[], Any], source: TableFile) -> Any:
    """A JSON Lines file; a line longer than pyarrow's 1 MiB block (a multi-megabyte document) is read with one
    block for the whole file instead of being refused as a "straddling object". A text stays a text: pyarrow reads
    one that looks like a date or time as a timestamp ("2024-01-01T10:00:00Z" would be written back "2024-01-01
    10:00:00"), so such columns are read again, given as text."""
    import pyarrow
    import pyarrow.json as json_reader

    def read(options: Any) -> tuple[Any, Any]:
        with open_stream() as stream:
            return json_reader.read_json(stream, read_options=options), options

    table, options = _whole_rows(read, json_reader.ReadOptions, open_stream, source)
    texts = [pyarrow.field(field.name, _as_text(field.type)) for field in table.schema
             if not _as_text(field.type).equals(field.type)]
    if not texts:
        return table
    with open_stream() as stream:  # the columns given come first: back in the file's order
        return json_reader.read_json(stream, read_options=options, parse_options=json_reader.ParseOptions(
            explicit_schema=pyarrow.schema(texts))).select(table.column_names)


def _whole_rows(read: Callable[[Any], Any], read_options: Callable[..., Any], open_stream: Callable[[], Any],
                source: TableFile) -> Any:
    """``read(options)`` with pyarrow's default block (None), then, where a row is longer than a block (pyarrow's
    "straddling object"), with ``read_options`` of one block for the whole file."""
    import pyarrow

    try:
        return read(None)
    except pyarrow.ArrowInvalid as exc:
        if "straddl" not in str(exc):
            raise
    return read(read_options(block_size=_whole_block(open_stream, source)))


def _whole_block(open_stream: Callable[[], Any], source: TableFile) -> int:
    """A pyarrow read block that holds the whole of ``source`` (decompressed), for a row longer than a block."""
    if source.stdio or source.gzipped:
        size = 0
        with open_stream() as stream:
            while chunk := stream.read(1 << 24):
                size += len(chunk)
    else:
        size = os.stat(source.path).st_size
    return min(max(size + 1, 1 << 20), (1 << 31) - 1)


def _as_text(kind: Any) -> Any:
    """The pyarrow type ``kind`` with each date or time (within structs and lists too) as a string."""
    import pyarrow

    if pyarrow.types.is_temporal(kind):
        return pyarrow.string()
    if pyarrow.types.is_struct(kind):
        return pyarrow.struct([field.with_type(_as_text(field.type)) for field in kind])
    if pyarrow.types.is_list(kind):
        return pyarrow.list_(kind.value_field.with_type(_as_text(kind.value_type)))
    if pyarrow.types.is_large_list(kind):
        return pyarrow.large_list(kind.value_field.with_type(_as_text(kind.value_type)))
    return kind


def _read_csv(open_stream: Callable[[], Any], text_columns: Sequence[str], source: TableFile) -> Any:
    """A CSV file, its cells kept as written: the text columns as strings (a column of numbers, "2024", is text
    to score), quoted values may hold newlines, and any other column is typed (int, float, bool, date) only where
    every cell reads back as the same text -- an id "00123", "1e5" or "N/A" stays as written. CSV has no null: an
    empty cell of a text column is an empty text, quoted or not. A row longer than pyarrow's 1 MiB block (a
    multi-megabyte document) is read with one block for the whole file."""
    import pyarrow
    import pyarrow.csv as csv

    try:
        return _whole_rows(lambda options: read_cells(open_stream, text_columns, options), csv.ReadOptions,
                           open_stream, source)
    except pyarrow.ArrowInvalid as exc:  # named by its column, as a JSONL file's (_check_text), not "#1"
        found = re.search(r"CSV column #(\d+): CSV conversion error to string: invalid UTF8", str(exc))
        if found is None:
            raise
        names = header_names(open_stream)  # not pyarrow's: its first block may end inside a long row
        column = int(found.group(1))
        name = repr(names[column]) if column < len(names) else f"#{column + 1}"
        raise InvalidRequest("--input", f"cannot read {source.name}: column {name} holds "
                                        "text that is not UTF-8 (save the file as UTF-8)") from None


def check_output(path: str | Path, file_format: str | None = None) -> TableFile:
    """``path`` as a table can be written there: a known suffix and a folder this process can create a file in
    (stdout, ``-``, needs only a format); ``InvalidRequest`` naming ``--output`` otherwise (checked before any row
    is scored)."""
    target = table_file(path, "--output", file_format)
    if target.stdio and sys.stdout is None:
        raise InvalidRequest("--output", "stdout is closed: name a file, or give the command a stdout")
    if target.stdio:
        return target
    path = Path(path)
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
    return target


def check_writable(table: Any, path: str | Path, file_format: str | None = None) -> None:
    """``InvalidRequest`` naming ``--output`` when ``table``'s columns cannot be written in ``path``'s format
    (a struct or list column as CSV), checked on its empty slice before any row is scored."""
    pyarrow = require_pyarrow()
    target = table_file(path, "--output", file_format)
    if target.format != "csv":
        return
    import pyarrow.csv as csv

    try:
        csv.write_csv(pyarrow_typed(table.slice(0, 0)), io.BytesIO())
    except (pyarrow.ArrowInvalid, pyarrow.ArrowNotImplementedError) as exc:
        raise InvalidRequest("--output", f"{target.name}: CSV cannot hold these columns ({exc}); write .jsonl or "
                                         ".parquet") from None


_TEMPORARY = r"\.{name}\.[0-9]+\.[0-9a-f]{{12}}\.tmp"  # write_table's temporary files of the output ``name``


def remove_stale_temporaries(path: str | Path) -> None:
    """Remove the temporary files ``write_table`` left beside ``path`` in runs killed while writing; only its own
    names (``out.jsonl.gz``'s, beside ``out.jsonl``, may be a live run's). The caller keeps live runs of ``path``
    away (``rerankit score`` holds its journal's lock)."""
    path = Path(path)
    ours = re.compile(_TEMPORARY.format(name=re.escape(path.name)))
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        if ours.fullmatch(stale.name):
            stale.unlink(missing_ok=True)


def write_table(table: Any, path: str | Path, file_format: str | None = None) -> None:
    """Write ``table`` as .parquet, .jsonl or .csv (gzipped where the name ends in .gz), by ``path``'s suffix, or to
    stdout as ``-`` in ``file_format``. A file goes into a temporary file beside it, renamed over ``path`` once
    whole, so an existing file is never left truncated; ``InvalidRequest`` naming ``--output`` if it cannot be
    written (a closed stdout raises ``BrokenPipeError``, for the command to end quietly)."""
    pyarrow = require_pyarrow()
    target = check_output(path, file_format)
    failures = (OSError, pyarrow.ArrowInvalid, pyarrow.ArrowNotImplementedError)
    if target.stdio:
        sys.stdout.flush()  # anything printed before goes first, not into the middle of the table
        try:
            _write(table, target.format, sys.stdout.buffer)
            sys.stdout.buffer.flush()
        except BrokenPipeError:
            raise
        except failures as exc:
            raise InvalidRequest("--output", f"cannot write to stdout: {exc}") from None
        return
    path = Path(path)
    # a name of its own beside the target, created as any new file is (the umask's mode), then renamed over it
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")  # _TEMPORARY matches it
    try:
        with temporary.open("xb") as raw:
            if target.gzipped:  # the header names the file within, as gzip does
                with gzip.GzipFile(filename=path.name, mode="wb", fileobj=raw, compresslevel=6) as packed:
                    _write(table, target.format, packed)
            else:
                _write(table, target.format, raw)
        if path.exists():  # the file replaced keeps its mode
            os.chmod(temporary, path.stat().st_mode & 0o7777)
        os.replace(temporary, path)
    except failures as exc:
        raise InvalidRequest("--output", f"cannot write {path}: {exc}") from None
    finally:
        temporary.unlink(missing_ok=True)


def _write(table: Any, file_format: str, sink: Any) -> None:
    """``table`` in ``file_format`` into the binary file object ``sink``."""
    if file_format == "parquet":
        import pyarrow.parquet as parquet

        parquet.write_table(pyarrow_typed(table), sink)
    elif file_format == "csv":
        import pyarrow.csv as csv

        csv.write_csv(pyarrow_typed(table), sink)
    else:
        for lines in _json_lines(table):
            sink.write(lines.encode("utf-8"))


def _json_lines(table: Any) -> Iterator[str]:
    """The rows of ``table`` as JSON lines, some thousands a piece: NaN and infinities as null, each number of a
    ``JSON_NUMBERS`` column and each value of a ``JSON_VALUES`` one as written."""
    numbers = [field.name for field in table.schema if marked(field, JSON_NUMBERS, JSON_VALUES)]
    for batch in table.to_batches(max_chunksize=BATCH_ROWS):
        lines = []
        for row in batch.to_pylist():
            for name in numbers:
                if row[name] is not None:
                    row[name] = json.loads(row[name])
            lines.append(json.dumps(_json_safe(row), ensure_ascii=False, default=str, allow_nan=False) + "\n")
        yield "".join(lines)


def _json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as null (JSON has no such numbers: ``NaN`` would make the line invalid)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    return value
