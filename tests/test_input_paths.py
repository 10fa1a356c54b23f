"""What ``rerankit score --ray`` reads of ``--input`` (``input_paths``): globs, and the format of a folder or glob
taken from its files' suffixes; resolved without Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pyarrow")
import pyarrow.fs  # noqa: E402

from rerankit import input_paths  # noqa: E402
from rerankit.cli import main  # noqa: E402
from rerankit.errors import InvalidRequest  # noqa: E402
from rerankit.input_paths import resolve_input  # noqa: E402

# as Ray's readers list a folder: JSON and Parquet files by their suffixes, every file for CSV
RAY_EXTENSIONS = {"parquet": (".parquet",), "jsonl": (".json", ".jsonl", ".json.gz", ".jsonl.gz"), "csv": None}


def _files(root: Path, *names: str) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text('{"query": "q", "document": "d"}\n')


def _names(shards) -> list[str]:
    return [name for name, _ in shards.files]


def test_a_glob_reads_the_files_it_matches(tmp_path, monkeypatch) -> None:
    """``*``, ``?``, ``[...]`` within a name and ``**`` across folders; names beginning with . or _ are left out,
    as Ray leaves them out of a folder; Ray is given the files (it takes no glob), by path."""
    monkeypatch.chdir(tmp_path)
    _files(tmp_path, "data/part-1.jsonl", "data/part-0.jsonl", "data/part-0.csv", "data/other.jsonl",
           "data/_part-9.jsonl", "data/.part-8.jsonl", "data/day=2/part-2.jsonl.gz", "data/_tmp/part-3.jsonl")

    shards = resolve_input("data/part-*.jsonl", None, RAY_EXTENSIONS)
    assert shards.format == "jsonl" and _names(shards) == ["data/part-0.jsonl", "data/part-1.jsonl"]
    assert shards.paths == [str(tmp_path / "data" / name) for name in ("part-0.jsonl", "part-1.jsonl")]
    assert shards.reading() == (shards.paths, {})
    assert _names(resolve_input("data/part-[1-2].jsonl", None, RAY_EXTENSIONS)) == ["data/part-1.jsonl"]
    assert _names(resolve_input("data/part-?.jsonl", None, RAY_EXTENSIONS)) == ["data/part-0.jsonl",
                                                                                 "data/part-1.jsonl"]
    assert _names(resolve_input("data/**/part-*.jsonl*", None, RAY_EXTENSIONS)) == \
        ["data/day=2/part-2.jsonl.gz", "data/part-0.jsonl", "data/part-1.jsonl"]
    assert _names(resolve_input("data/*/part-*.jsonl*", None, RAY_EXTENSIONS)) == ["data/day=2/part-2.jsonl.gz"]
    assert _names(resolve_input("data/d**", None, RAY_EXTENSIONS)) == ["data/day=2/part-2.jsonl.gz"]  # once
    assert _names(resolve_input(str(tmp_path / "data" / "*.csv"), None, RAY_EXTENSIONS)) == \
        [str(tmp_path / "data" / "part-0.csv")]


def test_a_glob_matching_nothing_is_an_input_error_naming_it(tmp_path, monkeypatch, capsys) -> None:
    """Before Ray starts (Ray's own error would be a traceback: it reads the pattern as one file's name)."""
    ray = pytest.importorskip("ray")
    monkeypatch.chdir(tmp_path)
    _files(tmp_path, "data/_part-0.jsonl", "data/notes.txt")
    for pattern in ("data/part-*.jsonl", "nowhere/*.jsonl", "data/*.jsonl"):
        with pytest.raises(InvalidRequest) as refused:
            resolve_input(pattern, None, RAY_EXTENSIONS)
        assert str(refused.value) == f"--input: {pattern} matches no jsonl file"
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: pytest.fail("Ray started"))
    assert main(["score", "--ray", "--input", "data/p*", "--output", "out"]) == 2
    assert capsys.readouterr().err == "error: --input: data/p* matches no file\n"


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".csv.gz"])
def test_a_folder_without_a_suffix_takes_its_files_format(tmp_path, suffix) -> None:
    _files(tmp_path, f"shards/part-0000{suffix}", f"shards/more/part-0001{suffix}", "shards/_SUCCESS",
           "shards/.part-0000.crc")
    shards = resolve_input(str(tmp_path / "shards"), None, RAY_EXTENSIONS)
    assert shards.format == suffix.split(".")[1] and shards.paths == str(tmp_path / "shards")
    assert _names(shards) == [str(tmp_path / "shards" / name) for name in (f"more/part-0001{suffix}",
                                                                            f"part-0000{suffix}")]
    assert resolve_input(f"{tmp_path}/shards/", None, RAY_EXTENSIONS).format == shards.format


@pytest.mark.parametrize("names, message", [
    (["a.jsonl", "b.jsonl", "c.jsonl", "d.csv"],
     "shards mixes formats: 3 .jsonl (shards/a.jsonl, shards/b.jsonl, ...), 1 .csv (shards/d.csv); give a glob of "
     "one, as 'shards/*.jsonl'"),
    (["a.json", "b.jsonl", "README"],
     "the suffixes of the files of shards tell no one format: 1 without a suffix (shards/README), 1 .json "
     "(shards/a.json), 1 .jsonl (shards/b.jsonl) (known: .parquet, .jsonl, .csv, .jsonl.gz, .csv.gz); give "
     "--format, or a glob of the files to read"),
    (["_SUCCESS"], "shards is a folder with no file in it"),
])
def test_a_folder_of_mixed_or_unknown_formats_is_an_input_error_naming_what_it_holds(tmp_path, monkeypatch, names,
                                                                                     message) -> None:
    monkeypatch.chdir(tmp_path)
    _files(tmp_path, *(f"shards/{name}" for name in names))
    with pytest.raises(InvalidRequest) as refused:
        resolve_input("shards", None, RAY_EXTENSIONS)
    assert str(refused.value) == f"--input: {message}"


def test_format_names_the_format_of_files_whose_names_do_not(tmp_path) -> None:
    """Every file is read as it (Ray's reader without its extension filter), a folder's or a glob's."""
    _files(tmp_path, "export/part-00000", "export/part-00001.json", "export/_SUCCESS")
    shards = resolve_input(str(tmp_path / "export"), "jsonl", RAY_EXTENSIONS)
    assert shards.format == "jsonl" and [Path(name).name for name in _names(shards)] == ["part-00000",
                                                                                          "part-00001.json"]
    assert shards.reading() == (str(tmp_path / "export"), {"file_extensions": None})
    shards = resolve_input(str(tmp_path / "export" / "part-*"), "jsonl", RAY_EXTENSIONS)
    assert shards.reading() == ([str(tmp_path / "export" / "part-00000"), str(tmp_path / "export" /
                                                                              "part-00001.json")],
                                {"file_extensions": None})


def test_a_folder_named_with_a_suffix_is_read_as_before(tmp_path) -> None:
    """Its name tells the format; of its files, those Ray's reader reads of a folder (notes.txt is left out)."""
    _files(tmp_path, "pairs.jsonl/a.jsonl", "pairs.jsonl/notes.txt", "pairs.jsonl/b.json")
    shards = resolve_input(str(tmp_path / "pairs.jsonl"), None, RAY_EXTENSIONS)
    assert shards.format == "jsonl" and shards.reading() == (str(tmp_path / "pairs.jsonl"), {})
    assert [Path(name).name for name in _names(shards)] == ["a.jsonl", "b.json"]
    with pytest.raises(InvalidRequest, match=r"--input: \S+notes.txt must end in one of .parquet, .jsonl, .csv, "
                                             r".jsonl.gz, .csv.gz \(or give --format\)"):
        resolve_input(str(tmp_path / "pairs.jsonl" / "notes.txt"), None, RAY_EXTENSIONS)


def test_a_remote_glob_is_listed_on_its_filesystem(monkeypatch) -> None:
    """``s3://bucket/pairs/part-*.parquet``: the files are listed with pyarrow's filesystem of the URI (here a
    mock one), and Ray is given them with that filesystem (their paths have no scheme)."""
    bucket = pyarrow.fs._MockFileSystem()
    for name in ("bucket/pairs/part-0.parquet", "bucket/pairs/part-1.parquet", "bucket/pairs/_SUCCESS",
                 "bucket/other/part-2.parquet"):
        bucket.create_dir(name.rsplit("/", 1)[0])
        with bucket.open_output_stream(name) as stream:
            stream.write(b"PAR1")
    def mock_of(uri: str) -> tuple:
        """The mock bucket for an ``s3://`` URI, parsed as pyarrow parses one (offline: as ``mock:``)."""
        return bucket, pyarrow.fs.FileSystem.from_uri(uri.replace("s3://", "mock:///"))[1]

    monkeypatch.setattr(input_paths, "filesystem_of", mock_of)

    shards = resolve_input("s3://bucket/pairs/part-*.parquet", None, RAY_EXTENSIONS)
    assert _names(shards) == ["s3://bucket/pairs/part-0.parquet", "s3://bucket/pairs/part-1.parquet"]
    assert shards.reading() == (["bucket/pairs/part-0.parquet", "bucket/pairs/part-1.parquet"],
                                {"filesystem": bucket})
    assert _names(resolve_input("s3://bucket/pairs/part-[1-9].parquet", None, RAY_EXTENSIONS)) == \
        ["s3://bucket/pairs/part-1.parquet"]  # as a URI, "[" is refused and "?" begins a query: not parsed so
    assert _names(resolve_input("s3://bucket/pairs/part-?.parquet", None, RAY_EXTENSIONS))[0] == \
        "s3://bucket/pairs/part-0.parquet"
    assert resolve_input("s3://bucket/pairs/", None, RAY_EXTENSIONS).format == "parquet"
    assert resolve_input("s3://bucket/*/part-*", None, RAY_EXTENSIONS).format == "parquet"
    with pytest.raises(InvalidRequest, match="--input: s3://bucket/pairs/x-\\* matches no file"):
        resolve_input("s3://bucket/pairs/x-*", None, RAY_EXTENSIONS)


@pytest.mark.parametrize("make", ["folder", "glob"])
def test_score_without_ray_names_a_folder_or_glob_as_one_file_only(tmp_path, monkeypatch, capsys, make) -> None:
    """Without --ray --input is one file (its rows are read whole, kept as written, and journaled by it); a
    folder or a glob is an error that says --ray reads them."""
    monkeypatch.chdir(tmp_path)
    _files(tmp_path, "pairs.jsonl/a.jsonl")
    source = "pairs.jsonl" if make == "folder" else "pairs.jsonl/*.jsonl"
    assert main(["score", "--input", source, "--output", "out.jsonl", "--no-progress"]) == 2
    assert capsys.readouterr().err == f"error: --input: {source} is a {make}: without --ray, --input names one " \
                                      "file (with --ray, a folder or a glob of shards)\n"
