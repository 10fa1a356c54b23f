"""CSV cells as written: ``rerankit score`` reads a CSV file once, every column as text, then types a column (other
than the text columns) only where pyarrow's CSV type inference would have typed it and every cell reads back as the
same text: ``123`` stays an int and ``2024-01-01`` a date, while ``00123``, ``1e5``, ``1.50`` and ``N/A`` stay as
written.

A cell reads back as written only in the one spelling pyarrow casts the value back to text in (``-5``, ``true``,
``1.5``, ``1e+20``, ``2024-01-01 10:00:00``), so only such spellings need the inference's order of types (int64,
bool, date32, time32, timestamp in seconds then nanoseconds, with a zone or without, float64): any other spelling
keeps its column as text whatever type it would have been read as.
"""

from __future__ import annotations

import csv
import io
from typing import Any, Callable, Sequence

HEAD_BYTES = 1 << 16  # read to find the header's names
LONGEST = 64  # characters: no cell written back from a typed value is longer ("-1.7976931348623157e+308": 24)
_TIME = r"^([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]$"  # a time32[s] as it is cast to text


def read_cells(open_stream: Callable[[], Any], text_columns: Sequence[str], read_options: Any) -> Any:
    """The CSV file ``open_stream()`` gives, read once: ``text_columns`` as strings (an empty cell an empty text), any
    other column typed as ``typed_as_written`` types it. The header's names are found from its first bytes so that
    every column is read as text; where that finding was wrong (a column pyarrow typed), pyarrow's own header is
    read and the file read again."""
    import pyarrow
    import pyarrow.csv as pyarrow_csv

    parse = pyarrow_csv.ParseOptions(newlines_in_values=True)

    def read(names: Sequence[str]) -> Any:
        convert = pyarrow_csv.ConvertOptions(column_types={name: pyarrow.string() for name in names})
        try:
            with open_stream() as stream:
                return pyarrow_csv.read_csv(stream, read_options=read_options, parse_options=parse,
                                            convert_options=convert)
        except pyarrow.ArrowInvalid as exc:  # pyarrow finds no columns in a header with no line break after it
            line = _lone_line(open_stream) if "Empty CSV file" in str(exc) else None
            if line is None:
                raise
            return pyarrow_csv.read_csv(io.BytesIO(line + b"\n"), read_options=read_options, parse_options=parse,
                                        convert_options=convert)

    table = read(header_names(open_stream))
    if not all(pyarrow.types.is_string(kind) for kind in table.schema.types):
        with open_stream() as stream:
            names = pyarrow_csv.open_csv(stream, read_options=read_options, parse_options=parse).schema.names
        table = read(names)
    return typed_as_written(table, text_columns)


def header_names(open_stream: Callable[[], Any]) -> list[str]:
    """The names of the CSV header in the first bytes ``open_stream()`` gives, as Python's ``csv`` reads them (a
    guess, checked by the caller: a name cut off or read otherwise than pyarrow reads it only costs a second read)."""
    with open_stream() as stream:
        head = stream.read(HEAD_BYTES)
    try:
        for row in csv.reader(io.StringIO(head.decode("utf-8", "replace").removeprefix("\ufeff"), newline="")):
            if row:
                return row
    except csv.Error:
        pass
    return []


def _lone_line(open_stream: Callable[[], Any]) -> bytes | None:
    """The bytes ``open_stream()`` gives where they are one short line with no line break (a header-only CSV file
    saved without a last newline), else None."""
    with open_stream() as stream:
        head = stream.read(HEAD_BYTES + 1)
    if len(head) > HEAD_BYTES or b"\n" in head or b"\r" in head or not head.strip():
        return None
    return head


def typed_as_written(table: Any, text_columns: Sequence[str]) -> Any:
    """``table`` (a CSV file read with every column as strings) with each column other than ``text_columns`` typed
    as pyarrow's CSV inference types it, where every cell reads back as the same text -- an empty cell as a null, a
    column of only empty cells as nulls; a table with two columns of one name as it is."""
    import pyarrow.csv as pyarrow_csv

    names = table.column_names
    if len(set(names)) != len(names):
        return table
    nulls = [value for value in pyarrow_csv.ConvertOptions().null_values if value]
    for position, name in enumerate(names):
        if name not in text_columns:
            typed = _typed(table.column(position), nulls)
            if typed is not None:
                table = table.set_column(position, name, typed)
    return table


def _typed(texts: Any, nulls: Sequence[str]) -> Any:
    """The string column ``texts`` typed, or None where it stays text."""
    import pyarrow
    import pyarrow.compute as compute

    if len(texts) and compute.max(compute.binary_length(texts)).as_py() > LONGEST:
        return None
    empty = compute.equal(texts, "")
    cells = texts
    if compute.any(empty).as_py():  # pyarrow reads an empty cell as null
        cells = compute.if_else(empty, pyarrow.scalar(None, pyarrow.string()), texts)
    if cells.null_count == len(cells):
        return pyarrow.chunked_array([pyarrow.nulls(len(cells))])  # as pyarrow infers a column of no values
    if compute.any(compute.is_in(cells, value_set=pyarrow.array(nulls, pyarrow.string()))).as_py():
        return None  # pyarrow reads "NA", "nan" and the like as null: the cell would not read back
    first = cells.slice(compute.index(empty, False).as_py(), 1)
    for parse in _parsers():
        try:
            parse(first)  # most columns of text fail here, before the whole column is parsed
            typed = parse(cells)
        except (pyarrow.ArrowInvalid, pyarrow.ArrowNotImplementedError):
            continue
        same = compute.equal(compute.cast(typed, pyarrow.string()).fill_null(""), texts)
        return typed if compute.all(same).as_py() else None
    return None


def _parsers() -> list[Callable[[Any], Any]]:
    """The types pyarrow's CSV type inference tries, in its order, each as a function parsing a string column."""
    import pyarrow
    import pyarrow.compute as compute

    kinds = [pyarrow.int64(), pyarrow.bool_(), pyarrow.date32(), None, *[
        pyarrow.timestamp(unit, zone) for unit in ("s", "ns") for zone in (None, "UTC")], pyarrow.float64()]
    return [_time if kind is None else (lambda cells, kind=kind: compute.cast(cells, kind)) for kind in kinds]


def _time(cells: Any) -> Any:
    """``cells`` as time32[s] where each is a time of day as HH:MM:SS (the only text a time32[s] is cast to);
    ``ArrowInvalid`` otherwise (pyarrow casts no text to a time)."""
    import pyarrow
    import pyarrow.compute as compute

    if not compute.all(compute.match_substring_regex(cells, _TIME)).as_py():
        raise pyarrow.ArrowInvalid("not a time of day")
    days = compute.binary_join_element_wise("1970-01-01 ", cells, "")
    return compute.cast(compute.cast(days, pyarrow.timestamp("s")), pyarrow.time32("s"))
