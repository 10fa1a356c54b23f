"""JSON Lines numbers as written: pyarrow reads a column of ``1000`` and ``2.5`` (or an int too large for int64) as
floats, and a struct or list field likewise; ``rerankit score`` writes them back to JSONL each as the int or float
it was, and scores a number in the query or document column as written.

``keep_written`` reads the file again, line by line, only where it must: where a float (top-level, or within a
struct or list) is a whole number, and -- for a top-level column -- a quick scan of the bytes finds an int written
as its value. ``pyarrow_typed`` gives the table pyarrow read back (for CSV and Parquet).
"""

from __future__ import annotations

import io
import json
import re
from typing import Any, Callable, Sequence

JSON_NUMBERS = {b"rerankit": b"json-numbers"}  # a string column holding JSON number literals as written
JSON_VALUES = {b"rerankit": b"json-values"}  # a string column holding JSON structs or lists, numbers as written
SCAN_BYTES = 1 << 20  # read at a time by the scan for ints


def keep_written(table: Any, open_stream: Callable[[], Any], text_columns: Sequence[str]) -> Any:
    """``table`` (as pyarrow read the JSON Lines ``open_stream()`` gives) with the numbers some row wrote as ints
    where pyarrow made floats as written: a float column as the numbers' JSON text, marked ``JSON_NUMBERS``; a
    struct or list column holding such a number (other than ``text_columns``) as each value's JSON, marked
    ``JSON_VALUES``. Rows that do not line up with the table's (a row spread over lines) leave it as it is."""
    import pyarrow

    if len(set(table.column_names)) != len(table.column_names):
        return table
    numbers = [field.name for field in table.schema
               if pyarrow.types.is_floating(field.type) and _whole_floats(table.column(field.name))]
    nested = [field.name for field in table.schema if pyarrow.types.is_nested(field.type)
              and field.name not in text_columns and _whole_floats(table.column(field.name))]
    if numbers and not nested and not _int_written(open_stream, numbers):
        return table
    if not numbers and not nested:
        return table  # no float could have been written as an int
    written = _written(open_stream, numbers + nested)
    if written is None or any(len(values) != table.num_rows for values in written.values()):
        return table
    for name in numbers:
        texts = written[name]
        if any(text is not None and (not isinstance(text, str) or len(text) > 4000) for text in texts):
            return table  # Python reads an int of at most 4300 digits
        if any(text is not None and _int_text(text) for text in texts):
            position = table.column_names.index(name)
            table = table.set_column(position, pyarrow.field(name, pyarrow.string(), metadata=JSON_NUMBERS),
                                     pyarrow.array(texts, type=pyarrow.string()))
    for name in nested:
        kind = table.schema.field(name).type
        if any(_int_as_float(value, kind) for value in written[name]):
            position = table.column_names.index(name)
            metadata = {**JSON_VALUES, b"type": pyarrow.schema([pyarrow.field("v", kind)]).serialize().to_pybytes()}
            texts = [None if value is None else json.dumps(_native(value, kind)) for value in written[name]]
            table = table.set_column(position, pyarrow.field(name, pyarrow.string(), metadata=metadata),
                                     pyarrow.array(texts, type=pyarrow.string()))
    return table


def marked(field: Any, *marks: dict) -> bool:
    """Whether the pyarrow ``field`` carries one of ``marks`` (``JSON_NUMBERS``, ``JSON_VALUES``)."""
    return any(field.metadata is not None and field.metadata.get(b"rerankit") == mark[b"rerankit"] for mark in marks)


def pyarrow_typed(table: Any) -> Any:
    """``table`` with its ``JSON_NUMBERS`` columns as float64 and its ``JSON_VALUES`` columns in their types, as
    pyarrow reads them (for CSV and Parquet)."""
    import pyarrow
    import pyarrow.json as json_reader

    for position, field in enumerate(table.schema):
        if marked(field, JSON_NUMBERS):
            table = table.set_column(position, field.name, table.column(position).cast(pyarrow.float64()))
        elif marked(field, JSON_VALUES):
            schema = pyarrow.ipc.read_schema(pyarrow.py_buffer(field.metadata[b"type"]))
            lines = b"".join(b'{"v":%s}\n' % (b"null" if text is None else text.encode())
                             for text in table.column(position).to_pylist())
            if not lines:
                column = pyarrow.chunked_array([], schema.field("v").type)
            else:
                column = json_reader.read_json(
                    io.BytesIO(lines), parse_options=json_reader.ParseOptions(explicit_schema=schema),
                    read_options=json_reader.ReadOptions(block_size=min(len(lines) + 1, (1 << 31) - 1))).column("v")
            table = table.set_column(position, field.name, column)
    return table


def _whole_floats(column: Any) -> bool:
    """Whether a float of ``column`` (or one within its structs and lists) is a whole number, as an int reads."""
    import pyarrow
    import pyarrow.compute as compute

    for chunk in column.chunks if isinstance(column, pyarrow.ChunkedArray) else [column]:
        kind = chunk.type
        if pyarrow.types.is_floating(kind):
            if compute.any(compute.equal(compute.floor(chunk), chunk)).as_py():
                return True
        elif pyarrow.types.is_struct(kind):
            if any(_whole_floats(chunk.field(index)) for index in range(kind.num_fields)):
                return True
        elif pyarrow.types.is_list(kind) or pyarrow.types.is_large_list(kind):
            if _whole_floats(chunk.flatten()):
                return True
    return False


def _int_written(open_stream: Callable[[], Any], names: Sequence[str]) -> bool:
    """Whether the JSON Lines file may write an int as the value of a key in ``names``: a scan of its bytes, much
    quicker than reading its lines as JSON. Read in runs of whole lines; a run that ends within an object (a row
    spread over lines) answers True."""
    keys = b"|".join(_key_pattern(name) for name in names)
    pattern = re.compile(rb"(?:%s)[ \t\r\n]*:[ \t\r\n]*-?[0-9]+[ \t\r\n]*[,}]" % keys)
    with open_stream() as stream:
        reader = io.BufferedReader(stream, SCAN_BYTES)
        while run := reader.read(SCAN_BYTES):
            run += reader.readline()
            if pattern.search(run) or run.rstrip()[-1:] not in (b"}", b""):
                return True
    return False


def _key_pattern(name: str) -> bytes:
    """A pattern matching ``name`` as a JSON string in UTF-8, each character as itself or escaped (``\\u0078``)."""
    forms = []
    for character in name:
        literal = re.escape(json.dumps(character, ensure_ascii=False)[1:-1].encode())
        units = character.encode("utf-16-be")
        escaped = b"".join(rb"\\u(?i:%s)" % units[at:at + 2].hex().encode() for at in range(0, len(units), 2))
        forms.append(b"(?:%s|%s%s)" % (literal, escaped, rb"|\\/" if character == "/" else b""))
    return b'"%s"' % b"".join(forms)


def _written(open_stream: Callable[[], Any], names: Sequence[str]) -> dict[str, list] | None:
    """The values of columns ``names`` in each row of the JSON Lines file, numbers as their texts (as are texts:
    a value's pyarrow type tells them apart); None where a line is not what pyarrow read (a row spread over lines)."""
    decoder = json.JSONDecoder(parse_int=str, parse_float=str, parse_constant=str)
    values: dict[str, list] = {name: [] for name in names}
    with open_stream() as stream:
        for number, line in enumerate(io.BufferedReader(stream, 1 << 20)):
            try:
                text = line.decode("utf-8-sig" if number == 0 else "utf-8")
            except ValueError:
                return None
            position = 0
            while (position := _skip_space(text, position)) < len(text):  # pyarrow takes several objects a line
                try:
                    record, position = decoder.raw_decode(text, position)
                except ValueError:
                    return None
                if not isinstance(record, dict):
                    return None
                for name in names:
                    values[name].append(record.get(name))
    return values


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def _int_text(text: str) -> bool:
    """Whether ``text``, a JSON number as written, is an int (``NaN`` and ``Infinity`` are not)."""
    return text.lstrip("-").isdigit()


def _int_as_float(value: Any, kind: Any) -> bool:
    """Whether ``value`` (as ``_written`` reads it) holds an int where its pyarrow type ``kind`` has a float."""
    import pyarrow

    if pyarrow.types.is_floating(kind):
        return isinstance(value, str) and _int_text(value)
    if pyarrow.types.is_struct(kind) and isinstance(value, dict):
        return any(_int_as_float(value.get(field.name), field.type) for field in kind)
    if (pyarrow.types.is_list(kind) or pyarrow.types.is_large_list(kind)) and isinstance(value, list):
        return any(_int_as_float(item, kind.value_type) for item in value)
    return False


def _native(value: Any, kind: Any) -> Any:
    """``value`` (as ``_written`` reads it, of pyarrow type ``kind``) with its numbers as Python ints and floats."""
    import pyarrow

    if not isinstance(value, (str, dict, list)):
        return value  # null, true, false
    if pyarrow.types.is_floating(kind):
        return int(value) if _int_text(value) else float(value)
    if pyarrow.types.is_integer(kind):
        return int(value)
    if pyarrow.types.is_struct(kind) and isinstance(value, dict):
        fields = {field.name: field.type for field in kind}
        return {key: _native(item, fields[key]) if key in fields else item for key, item in value.items()}
    if (pyarrow.types.is_list(kind) or pyarrow.types.is_large_list(kind)) and isinstance(value, list):
        return [_native(item, kind.value_type) for item in value]
    return value
