"""The files of ``rerankit score``: a table read from and written to .parquet, .jsonl or .csv, by suffix, with its
cells as written, and written whole or not at all (a temporary file renamed over the target)."""

from __future__ import annotations

import math
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any, Sequence

from rerankit.errors import InvalidRequest, RerankitError

SUFFIXES = (".parquet", ".jsonl", ".csv")


def require_pyarrow() -> Any:
    """The ``pyarrow`` module, or a ``RerankitError`` naming the pip command."""
    try:
        import pyarrow
    except ImportError:
        raise RerankitError("reading and writing tables needs pyarrow: pip install 'rerankit[ray]'") from None
    return pyarrow


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
