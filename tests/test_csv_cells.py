"""CSV cells as written, read in one pass (``rerankit.csv_cells``), against the former reading that parsed the file
three times (its header, every column as text, every column type-inferred) and kept an inferred column only where
each cell read back as its text: the tables must be the same -- schema, types and values -- on generated CSVs of
numbers, bools, dates, times and timestamps in many spellings, empty and null-like cells, quoted values and unicode,
and through ``read_table`` on a row longer than a read block, gzip, and text that is not UTF-8."""

from __future__ import annotations

import datetime
import gzip
import random
import struct

import pytest

pyarrow = pytest.importorskip("pyarrow")
import pyarrow.compute as compute  # noqa: E402
import pyarrow.csv as pyarrow_csv  # noqa: E402

from rerankit import csv_cells, table_files  # noqa: E402
from rerankit.errors import InvalidRequest  # noqa: E402


def former_read_csv_cells(open_stream, text_columns, options):
    """The former ``table_files._read_csv_cells``, as it was: the reference the one-pass reading must match."""
    parse = pyarrow_csv.ParseOptions(newlines_in_values=True)
    with open_stream() as stream:
        names = pyarrow_csv.open_csv(stream, read_options=options, parse_options=parse).schema.names
    with open_stream() as stream:
        as_text = pyarrow_csv.read_csv(stream, read_options=options, parse_options=parse,
                                       convert_options=pyarrow_csv.ConvertOptions(
                                           column_types={name: pyarrow.string() for name in names}))
    with open_stream() as stream:
        typed = pyarrow_csv.read_csv(stream, read_options=options, parse_options=parse,
                                     convert_options=pyarrow_csv.ConvertOptions(
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


def _outcome(read):
    try:
        return read()
    except (pyarrow.ArrowInvalid, InvalidRequest, UnicodeDecodeError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _assert_same(new, old, data):
    if isinstance(old, str) or isinstance(new, str):
        assert new == old, data
        return
    assert new.schema.equals(old.schema, check_metadata=True), (new.schema, old.schema, data)
    for name, mine, theirs in zip(new.column_names, new.columns, old.columns):
        assert mine.equals(theirs), (name, mine, theirs, data)
        # -0.0 equals 0.0: the texts tell them apart
        assert compute.cast(mine, pyarrow.string()).to_pylist() == compute.cast(theirs, pyarrow.string()).to_pylist()


def _compare(data: bytes, text_columns, options=None):
    def open_stream():
        return pyarrow.BufferReader(data)

    # One line and no line break: the former reading refused it (pyarrow's "Empty CSV file"); it is now read as the
    # same line ending in a line break is, a header and no rows.
    ended = data + b"\n" if data.strip() and b"\n" not in data and b"\r" not in data else data
    new = _outcome(lambda: csv_cells.read_cells(open_stream, text_columns, options))
    old = _outcome(lambda: former_read_csv_cells(lambda: pyarrow.BufferReader(ended), text_columns, options))
    _assert_same(new, old, data)
    return new


def _cast_text(values, kind):
    return compute.cast(pyarrow.array(values, kind), pyarrow.string()).to_pylist()


def _double(rng):
    pick = rng.randrange(8)
    if pick == 0:
        return rng.choice([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 5e-324, 1.7976931348623157e308,
                           1e-7, 1e15, 1e16, 1e21, 0.1, 2.5])
    if pick == 1:
        return float(rng.randrange(-1000, 1000))  # written "12": an int to pyarrow unless another cell is not
    if pick == 2:
        return struct.unpack("d", rng.randbytes(8))[0]
    return round(rng.uniform(-1e4, 1e4), rng.randrange(0, 6)) * 10.0 ** rng.randrange(-12, 12)


def _instant(rng):
    return datetime.datetime(rng.randrange(1, 10000), rng.randrange(1, 13), rng.randrange(1, 29),
                             rng.randrange(24), rng.randrange(60), rng.randrange(60))


def _canonical(kind, rng):
    """A cell as pyarrow writes the typed value back as text (it reads back as written)."""
    if kind == "int":
        return str(rng.choice([0, rng.randrange(-100, 100), rng.randrange(-2**63, 2**63), 2**63 - 1, -2**63]))
    if kind == "float":
        value = _double(rng)
        return "nan" if value != value else _cast_text([value], pyarrow.float64())[0]
    if kind == "bool":
        return rng.choice(["true", "false"])
    if kind == "date":
        return _instant(rng).date().isoformat()
    if kind == "time":
        return _instant(rng).time().isoformat()
    when = _instant(rng)
    if kind == "timestamp":
        return when.isoformat(" ")
    if kind == "timestamp_ns":
        return when.replace(year=rng.randrange(1678, 2262)).isoformat(" ") + f".{rng.randrange(10**9):09d}"
    if kind == "timestamp_z":
        return when.isoformat(" ") + "Z"
    return when.replace(year=rng.randrange(1678, 2262)).isoformat(" ") + f".{rng.randrange(10**9):09d}Z"


ODD = {  # spellings pyarrow reads as the type (or nearly) that do not read back as written
    "int": ["00123", "+5", " 5", "5 ", "0x1F", "-0", "1_000", "9223372036854775808", "-9223372036854775809",
            "\u0661\u0662", "1.", "007"],
    "float": ["1e5", "1E5", "1.0", ".5", "5.", "1.50", "Infinity", "-Infinity", "INF", "1e400", "+1.5", " 1.5",
              "1,5", "0.1000", "1e-5", "-.0", "1e+5", "3.14abc", "1d5"],
    "bool": ["True", "False", "TRUE", "FALSE", "1", "0", "yes", "t", "F", " true"],
    "date": ["2024-1-1", "2024/01/01", "2024-02-30", "0000-01-01", "20240101", "2024-01-01 ", "+2024-01-01"],
    "time": ["10:00", "24:00:00", "10:00:00.5", "1:00:00", "23:59:60", "10:00:00Z", "10h00"],
    "timestamp": ["2024-01-01T10:00:00", "2024-01-01 10:00", "2024-01-01 10", "2024-01-01 10:00:00+01:00",
                  "2024-01-01 10:00:00.123", "2024-01-01 10:00:00.5Z", "2024-01-01T10:00:00Z",
                  "1677-01-01 00:00:00.000000000", "2024-01-01 10:00:00.000000000", "2024-01-01 10:00:00 "],
}
ODD["timestamp_ns"] = ODD["timestamp_z"] = ODD["timestamp_nsz"] = ODD["timestamp"]
NULLS = [value for value in pyarrow_csv.ConvertOptions().null_values if value] + ["none", "NONE", " NA"]
WORDS = ["query", "Straße", "naïve café", "文書", "emoji 🙂", "a,b", 'say "hi"', "two\nlines", "cr\r\nlf", " pad ",
         "-", "#", "x" * 70]
KINDS = ["int", "float", "bool", "date", "time", "timestamp", "timestamp_ns", "timestamp_z", "timestamp_nsz"]


def _cell(flavor, rng):
    kind, odd, empty = flavor
    roll = rng.random()
    if roll < empty:
        return ""
    if roll < empty + odd:
        return rng.choice(rng.choice([ODD.get(kind, WORDS), ODD.get(kind, WORDS), NULLS, WORDS]))
    return rng.choice(WORDS) if kind == "text" else _canonical(kind, rng)


def _flavor(rng):
    kind = rng.choice([*KINDS, *KINDS, "text", "empty", "mixed"])
    if kind == "empty":
        return ("int", 0.0, 1.0)
    if kind == "mixed":  # canonical cells of two types: int beside float, date beside timestamp, ...
        return ("mixed", tuple(rng.sample(KINDS, 2)), rng.choice([0.0, 0.2]))
    return (kind, rng.choice([0.0, 0.0, 0.02, 0.3]), rng.choice([0.0, 0.0, 0.1, 0.5]))


def _mixed_cell(flavor, rng):
    if flavor[0] != "mixed":
        return _cell(flavor, rng)
    return "" if rng.random() < flavor[2] else _canonical(rng.choice(flavor[1]), rng)


def _quoted(cell, rng):
    if any(char in cell for char in ',"\r\n') or (cell and rng.random() < 0.2) or (not cell and rng.random() < 0.1):
        return '"' + cell.replace('"', '""') + '"'
    return cell


def _generated_csv(rng):
    columns = rng.randrange(1, 6)
    names = [rng.choice(["id", "n", "score", "query", "document", "día", "a,b", "when", "flag", ""]) + str(i)
             for i in range(columns)]
    if rng.random() < 0.05:
        names[-1] = names[0]  # two columns of one name
    flavors = [_flavor(rng) for _ in names]
    rows = [[_mixed_cell(flavor, rng) for flavor in flavors] for _ in range(rng.choice([0, 1, 2, 5, 20, 60]))]
    newline = rng.choice(["\n", "\r\n"])
    lines = [",".join(_quoted(cell, rng) for cell in row) for row in [names, *rows]]
    if columns == 1:  # a row of one empty cell is a blank line, which pyarrow skips: quote it
        lines = [line or '""' for line in lines]
    text = newline.join(lines) + (newline if rng.random() < 0.8 else "")
    bom = "\ufeff" if rng.random() < 0.05 else ""
    texts = rng.sample(names, rng.randrange(0, columns + 1)) + (["absent"] if rng.random() < 0.1 else [])
    return (bom + text).encode(), texts


@pytest.mark.parametrize("seed", range(4))
def test_generated_csvs_read_as_the_former_reading_read_them(seed):
    rng = random.Random(seed)
    kinds = set()
    for _ in range(100):
        data, texts = _generated_csv(rng)
        table = _compare(data, texts)
        if not isinstance(table, str):
            kinds.update(str(kind) for kind in table.schema.types)
    if seed == 0:  # the generated columns come out typed in each type pyarrow infers, and as text
        assert {"int64", "double", "bool", "date32[day]", "time32[s]", "timestamp[s]", "timestamp[ns]",
                "timestamp[s, tz=UTC]", "timestamp[ns, tz=UTC]", "null", "string"} <= kinds, kinds


CASES = {
    "ints": "id,n\n1,00123\n2,-5\n3,\n",
    "an int that is not": "n\n1\n2\n007\n",
    "leading zero only": "n\n0\n-0\n",
    "sign and spaces": "n,m,k\n+1,1 , 1\n2,2,2\n",
    "hex": "n\n0x10\n",
    "floats": "x,y,z\n1.5,1e5,inf\n-0,1.0,-inf\n0.1,.5,1e+20\n",
    "float beside ints": "x\n1\n2.5\n-0\n100000\n",
    "minus zero alone": "x\n-0\n5\n",
    "nan": "x,y,z\n1.5,nan,-nan\n2.5,NaN,1\nnan,,2.5\n",
    "null spellings": "a,b,c,d\nNA,null,N/A,#N/A\n1,2,3,4\n",
    "only null spellings": "a\nNA\nnull\n\n",
    "bools": "a,b,c,d\ntrue,True,1,true\nfalse,FALSE,0,1\n",
    "dates": "d,e\n2024-01-01,2024-01-01\n0001-12-31,2024-01-01 10:00:00\n",
    "times": "t,u\n10:00:00,10:00\n23:59:59,23:59:59\n",
    "timestamps": ("s,ns,z,nsz,off,iso\n2024-01-01 10:00:00,2024-01-01 10:00:00.123456789,2024-01-01 10:00:00Z,"
                   "2024-01-01 10:00:00.000000001Z,2024-01-01 10:00:00+01:00,2024-01-01T10:00:00\n"),
    "zone beside none": "t\n2024-01-01 10:00:00Z\n2024-01-01 10:00:00\n",
    "empty cells": 'a,b,c\n,"",1\n"",,\n',
    "all empty": "a,b\n,\n,\n",
    "quoted newlines and commas": 'query,document,n\n"q, 1","line\nbreak",1\n"""q""","x\r\ny",2\n',
    "unicode": "query,n\nStraße,١\n文書,2\n",
    "numeric except one cell": "n,query\n1,a\n2,b\nthree,c\n",
    "header only": "query,document,id\n",
    "header only, no newline": "query,document,id",
    "blank lines": "a,b\n\n1,2\n\n\n3,4\n",
    "bom": "\ufeffid,query\n1,q\n",
    "header with a quoted comma and newline": '"a,b","c\nd",e\n1,2,3\n',
    "duplicate names": "n,n,query\n1,2,q\n",
    "empty name": ",n\n1,2\n",
    "too many cells": "a,b\n1,2\n1,2,3\n",
    "too few cells": "a,b\n1,2\n3\n",
    "unterminated quote": 'a,b\n1,"2\n',
}


@pytest.mark.parametrize("data", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("texts", [[], ["query", "document"], ["n", "x", "a", "d", "t", "s", "id"]])
def test_edge_cases_read_as_the_former_reading_read_them(data, texts):
    _compare(data.encode(), texts)


def test_a_column_typed_in_its_first_block_and_text_in_a_later_one():
    ids = "".join(f"{row},{'d' * 100},{row / 4},{'2024-01-01' if row % 7 else ''}\n" for row in range(20000))
    for tail in ["x,y,1.5,2024-01-02\n", "3,y,abc,\n", "3,y,2.5,2024-01-02 10:00:00\n", "3,y,nan,\n"]:
        data = ("n,document,f,day\n" + ids + tail).encode()  # 2 MB: past pyarrow's first 1 MiB block
        table = _compare(data, ["document"])
        assert table.num_rows == 20001


def _read(path, columns, former, monkeypatch):
    with monkeypatch.context() as patched:
        if former:
            patched.setattr(table_files, "read_cells", former_read_csv_cells)
        return _outcome(lambda: table_files.read_table(path, columns))


@pytest.mark.parametrize("name, data", [
    ("long.csv", f'query,document,n\nq,"{"clause, " * 200000}",00123\nq,short,1\n'.encode()),
    ("long.csv.gz", gzip.compress(f'query,n,document\nq,1,short\nq,2,"{"a" * (3 << 20)}"\n'.encode())),
    ("short.csv.gz", gzip.compress(b"query,document,n,x\nq,d,1,1.5\nq,e,2,1e5\n")),
    ("not-gzip.csv.gz", b"query,document\nq,d\n"),
    ("cut.csv.gz", gzip.compress(b"query,document,n\n" + b"q,d,1\n" * 1000)[:-8]),
    ("cut-early.csv.gz", gzip.compress(b"query,document,n\n" + b"q,d,1\n" * 1000)[:40]),
    ("empty.csv", b""), ("blank.csv", b"\n\n"), ("header.csv", b"query,document,id\n"),
    ("latin1-document.csv", b"query,document,note\nq,caf\xe9,n\n"),
    ("latin1-note.csv", b"query,document,note\nq,d,caf\xe9\n"),
    ("latin1-id.csv", b"query,document,id\nq,d,1\nq,d,\xe9\n"),
    ("latin1-header.csv", b"query,document,caf\xe9\nq,d,1\n"),
    ("latin1-long.csv", f'query,document,note\nq,"{"b" * (2 << 20)}",n\xe9\n'.encode("latin-1")),
], ids=lambda value: value if isinstance(value, str) else "")
def test_read_table_reads_as_the_former_reading_did(tmp_path, monkeypatch, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    new = _read(path, ["query", "document"], False, monkeypatch)
    _assert_same(new, _read(path, ["query", "document"], True, monkeypatch), name)
    if name in ("latin1-document.csv", "latin1-note.csv", "latin1-id.csv", "latin1-long.csv"):
        column = {"latin1-id.csv": "id", "latin1-note.csv": "note", "latin1-long.csv": "note"}.get(name, "document")
        assert new.endswith(f"column {column!r} holds text that is not UTF-8 (save the file as UTF-8)")


def _count_reads(monkeypatch):
    calls = []
    for name in ("read_csv", "open_csv"):
        original = getattr(pyarrow_csv, name)
        monkeypatch.setattr(pyarrow_csv, name, lambda *args, name=name, original=original, **kwargs: (
            calls.append(name), original(*args, **kwargs))[1])
    return calls


def test_the_file_is_parsed_once(monkeypatch):
    data = b"id,query,document,score\n00123,q,d,1.5\n7,q,e,2\n"
    calls = _count_reads(monkeypatch)
    table = csv_cells.read_cells(lambda: pyarrow.BufferReader(data), ["query", "document"], None)
    assert calls == ["read_csv"]
    assert table.to_pylist()[0] == {"id": "00123", "query": "q", "document": "d", "score": 1.5}


@pytest.mark.parametrize("data", [b"query,n\nq,1\n", b'"q\nuery",n,"a,b"\nq,1,2\n', b"query,n,m\nq,1,\xe9\n"])
def test_a_header_found_otherwise_than_pyarrow_reads_it_is_read_again(monkeypatch, data):
    monkeypatch.setattr(csv_cells, "HEAD_BYTES", 3)  # the header's names cut short: "n" is read as ints
    calls = _count_reads(monkeypatch)
    table = _compare(data, ["query"])
    assert calls[:3] == ["read_csv", "open_csv", "read_csv"]
    assert isinstance(table, str) or str(table.schema.field("n").type) == "int64"


@pytest.mark.parametrize("name, data", [("header.csv", b"query,document,id"),
                                        ("header.csv.gz", gzip.compress(b"query,document,id")),
                                        ("header-crlf-less.csv", b"\xef\xbb\xbfquery,document")])
def test_a_header_with_no_line_break_after_it_is_a_file_of_no_rows(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    table = table_files.read_table(path, ["query", "document"])
    assert table.num_rows == 0 and table.column_names[:2] == ["query", "document"]


def test_a_column_name_that_is_not_utf8_is_named_as_the_problem(tmp_path):
    path = tmp_path / "latin1-header.csv"
    path.write_bytes(b"query,document,caf\xe9\nq,d,1\n")
    with pytest.raises(InvalidRequest, match=r"latin1-header.csv: a column name is not UTF-8 text") as caught:
        table_files.read_table(path, ["query", "document"])
    assert caught.value.field == "--input"
