"""Ray on a local 2-CPU cluster: the Serve deployment answers like ``rerankit serve``; ``score_dataset`` like
``Reranker.score``."""

from __future__ import annotations

import gzip
import json
import os
import random
import socket
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")

from live_server import live_server  # noqa: E402

from rerankit import Reranker  # noqa: E402
from rerankit.engine import EmbeddedBackend  # noqa: E402
from rerankit.errors import InvalidRequest  # noqa: E402
from rerankit.input_paths import resolve_input  # noqa: E402
from rerankit.integrations.ray import build_app, score_dataset  # noqa: E402
from rerankit.schema import ScoreRequest  # noqa: E402
from rerankit.server.app import create_app  # noqa: E402

pytestmark = pytest.mark.ray

WORDS = "capital france paris gravity force bodies river city famous museum tower quick brown fox".split()
BODIES = {
    "/v1/rerank": {"model": "m", "query": "capital of france", "documents": ["Paris is the capital.", "Gravity pulls.",
                                                                            "The Seine is a river."]},
    "/rerank": {"query": "gravity", "texts": ["Gravity is a force.", "Paris has museums."]},
}


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 2 CPUs; its workers import this checkout's rerankit (and the tests' helpers). They
    inherit the variables from the environment the cluster starts in, not from a runtime_env: a worker of a job
    with a runtime_env is started for it (~0.5-1 s each actor) instead of being taken from the idle ones Ray keeps."""
    source = str(Path(__file__).resolve().parents[2] / "src")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]))
        env.setenv("TOKENIZERS_PARALLELISM", "false")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_serve_deployment_answers_every_route_like_rerankit_serve(cluster, tiny_bert_cross_encoder,
                                                                 monkeypatch) -> None:
    from ray import serve
    from ray.serve._private import client as serve_client

    # Serve's client asks whether the app is running, and at shutdown whether it is gone, once a second; and a
    # replica waits 2 s for requests in flight before it stops (none here). Neither is what this test is about.
    monkeypatch.setattr(serve_client, "CLIENT_POLLING_INTERVAL_S", 0.05, raising=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        app = build_app(str(tiny_bert_cross_encoder), num_replicas=1, ray_actor_options={"num_cpus": 0.5},
                        device="cpu")
        app._bound_deployment = app._bound_deployment.options(graceful_shutdown_wait_loop_s=0.05,
                                                              graceful_shutdown_timeout_s=1)
        serve.run(app, name="rerankit", route_prefix="/")
        backend = EmbeddedBackend(str(tiny_bert_cross_encoder), device="cpu")
        with live_server(create_app(backend)) as local, httpx.Client(timeout=60) as client:
            for path, body in BODIES.items():
                on_ray = client.post(f"http://127.0.0.1:{port}{path}", json=body)
                alone = client.post(f"{local}{path}", json=body)
                assert on_ray.status_code == alone.status_code == 200, on_ray.text
                assert _same_scores(on_ray.json(), alone.json()), (on_ray.json(), alone.json())
            refused = client.post(f"http://127.0.0.1:{port}/v1/rerank", json={"query": "q", "documents": []})
            assert refused.status_code == 400 and "documents" in refused.text
        backend.close()
    finally:
        serve.shutdown()


def _same_scores(got, expected) -> bool:
    """Responses that differ only in ids and timings: the same indexes and scores, in the same order."""
    def pairs(payload):
        rows = payload["results"] if isinstance(payload, dict) else payload
        return [(row["index"], row.get("relevance_score", row.get("score"))) for row in rows]

    return [index for index, _ in pairs(got)] == [index for index, _ in pairs(expected)] and \
        [score for _, score in pairs(got)] == pytest.approx([score for _, score in pairs(expected)], abs=1e-6)


def test_score_dataset_names_a_missing_column(cluster) -> None:
    with pytest.raises(InvalidRequest, match="document_column"):
        score_dataset(ray.data.from_items([{"query": "q", "text": "t"}]))


def test_score_dataset_matches_reranker_score_through_rerankit_score_ray(
        cluster, tiny_bert_cross_encoder, tmp_path) -> None:
    import pyarrow
    import pyarrow.parquet as parquet

    from rerankit.cli import main

    rng = random.Random(0)
    queries = [" ".join(rng.choices(WORDS, k=4)) for _ in range(30)]
    rows = [{"row": row, "query": queries[row % len(queries)], "document": " ".join(rng.choices(WORDS, k=12))}
            for row in range(300)]
    parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "pairs.parquet")

    # three batches, each with rows of every query
    assert main(["score", "--ray", "--input", str(tmp_path / "pairs.parquet"), "--output", str(tmp_path / "out"),
                 "--model", str(tiny_bert_cross_encoder), "--device", "cpu", "--batch-size", "100"]) == 0
    scored = parquet.read_table(tmp_path / "out").to_pylist()
    assert sorted(row["row"] for row in scored) == list(range(len(rows)))
    with Reranker(str(tiny_bert_cross_encoder), device="cpu") as reranker:
        for query in queries:
            mine = sorted((row for row in scored if row["query"] == query), key=lambda row: row["row"])
            expected = reranker.score(ScoreRequest(query=query, items=[row["document"] for row in mine])).scores
            assert [row["score"] for row in mine] == pytest.approx(expected, abs=1e-5)


def test_serve_run_builder_takes_string_arguments_and_names_a_bad_one() -> None:
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary as serve_run_builds

    from rerankit.integrations.ray import app

    built = serve_run_builds(app, {"model": "m", "num_replicas": "2", "num_gpus": "1", "device": "cuda"})
    deployment = built._bound_deployment
    assert deployment._deployment_config.num_replicas == 2 and deployment.ray_actor_options["num_gpus"] == 1
    assert deployment.init_args == ("m", {"device": "cuda"}, {})
    with pytest.raises(InvalidRequest, match="num_replicas"):
        serve_run_builds(app, {"num_replicas": "two"})


def test_score_ray_refuses_a_folder_that_is_not_empty_and_gpus_the_local_cluster_lacks(cluster, tmp_path,
                                                                                     capsys) -> None:
    """Ray appends to a folder (a second run would hold every row twice), and a local cluster never gains a GPU
    (its actors would wait for ever): both refused before any row is read."""
    from rerankit.cli import main

    source, target = tmp_path / "pairs.jsonl", tmp_path / "out"
    source.write_text('{"query": "q", "document": "d"}\n')
    target.mkdir()
    (target / "part-0.parquet").write_bytes(b"earlier run")
    assert main(["score", "--ray", "--input", str(source), "--output", str(target)]) == 2
    assert "is a folder that is not empty" in capsys.readouterr().err
    assert main(["score", "--ray", "--input", str(source), "--output", str(tmp_path / "new"),
                 "--num-gpus", "1"]) == 2
    assert "this machine's Ray cluster has 0" in capsys.readouterr().err


def test_score_ray_names_a_bad_model_in_one_line(cluster, tmp_path, capsys) -> None:
    from rerankit.cli import main

    source = tmp_path / "pairs.jsonl"
    source.write_text('{"query": "q", "document": "d"}\n{"query": "q", "document": null}\n')
    assert main(["score", "--ray", "--input", str(source), "--output", str(tmp_path / "out"),
                 "--model", str(tmp_path / "no-such-model"), "--device", "cpu"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "no model folder" in error and error.count("\n") == 1, error[-2000:]


def test_score_ray_matches_the_input_suffix_in_any_case(tmp_path, capsys) -> None:
    """As without --ray (docs/cli.md: suffixes match in any case); checked before Ray starts."""
    from rerankit.cli import main

    source, target = tmp_path / "PAIRS.JSONL", tmp_path / "out"
    source.write_text('{"query": "q", "document": "d"}\n')
    target.mkdir()
    (target / "part-0.parquet").write_bytes(b"earlier run")
    assert main(["score", "--ray", "--input", str(source), "--output", str(target)]) == 2
    assert "is a folder that is not empty" in capsys.readouterr().err  # past the suffix


@pytest.fixture(scope="module")
def served_model(tiny_bert_cross_encoder):
    """The tiny model behind a server in this process: a Ray actor given its URL starts in a fraction of the time
    one that loads the model takes (no torch to import)."""
    backend = EmbeddedBackend(str(tiny_bert_cross_encoder), device="cpu")
    with live_server(create_app(backend)) as url:
        yield url
    backend.close()


def _pairs(rows: range) -> list[dict]:
    return [{"row": row, "query": f"query {row % 2}", "document": " ".join(WORDS[row:row + 5])} for row in rows]


def _shard(path: Path, rows: list[dict] | bytes) -> None:
    """``rows`` as JSONL or CSV by ``path``'s suffix (gzipped for .gz), or the bytes given."""
    if not isinstance(rows, bytes):
        if ".csv" in path.name:
            rows = "".join(["row,query,document\n", *(f"{r['row']},{r['query']},{r['document']}\n" for r in rows)])
        else:
            rows = "".join(json.dumps(row) + "\n" for row in rows)
        rows = rows.encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(rows) if path.name.endswith(".gz") else rows)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_score_ray_leaves_out_empty_shards_as_without_ray(cluster, served_model, tmp_path, suffix) -> None:
    """A folder of shards where some are empty (0 bytes, blank lines, gzipped blank lines, a CSV header alone):
    they add no row, as without --ray (Ray's CSV reader fails on an empty file); every other row once."""
    import pyarrow.parquet as parquet

    from rerankit.cli import main

    source = tmp_path / f"pairs{suffix}"
    _shard(source / f"part-0{suffix}", _pairs(range(0, 3)))
    _shard(source / f"part-1{suffix}", b"")
    _shard(source / f"part-2{suffix}", b"\n \n\t\n" if suffix == ".jsonl" else b"row,query,document\n")
    _shard(source / f"part-3{suffix}.gz", b"\r\n\n")
    _shard(source / "more" / f"part-4{suffix}.gz", _pairs(range(3, 5)))

    assert main(["score", "--ray", "--input", str(source), "--output", str(tmp_path / "out"),
                 "--model", served_model]) == 0

    scored = sorted(parquet.read_table(tmp_path / "out").to_pylist(), key=lambda row: int(row["row"]))
    assert [(int(row["row"]), row["query"], row["document"]) for row in scored] == \
        [(row["row"], row["query"], row["document"]) for row in _pairs(range(5))]
    assert all(isinstance(row["score"], float) for row in scored)


def test_score_ray_reads_a_glob_of_files_named_without_a_suffix(cluster, served_model, tmp_path) -> None:
    """A Spark export read as ``--input 'export/part-*' --format jsonl``: Ray's readers take no glob (they are given
    the files it matches) and read a JSON file by its suffix only (here without that filter); _SUCCESS and the
    other folder are left out, an empty shard adds no row, a gzipped one is read."""
    import pyarrow.parquet as parquet

    from rerankit.cli import main

    export = tmp_path / "export"
    _shard(export / "part-00000", _pairs(range(0, 3)))
    _shard(export / "part-00001.gz", _pairs(range(3, 5)))
    _shard(export / "part-00002", b"")
    _shard(export / "_SUCCESS", b"")
    _shard(export / "logs" / "part-00003", b"not JSON")

    assert main(["score", "--ray", "--input", str(export / "part-*"), "--format", "jsonl", "--output",
                 str(tmp_path / "out"), "--model", served_model]) == 0

    scored = sorted(parquet.read_table(tmp_path / "out").to_pylist(), key=lambda row: int(row["row"]))
    assert [(int(row["row"]), row["query"], row["document"]) for row in scored] == \
        [(row["row"], row["query"], row["document"]) for row in _pairs(range(5))]
    assert all(isinstance(row["score"], float) for row in scored)


@pytest.mark.parametrize("files, columns", [
    ({"pairs.jsonl": b""}, ["query", "document"]),
    ({"pairs.jsonl/a.jsonl": b"", "pairs.jsonl/b.jsonl": b"\n\n", "pairs.jsonl/c.jsonl.gz": gzip.compress(b"\n")},
     ["query", "document"]),
    ({"pairs.csv": b""}, ["query", "document"]),
    ({"pairs.csv": b"query,document,id\n"}, ["query", "document", "id"]),
    ({"pairs.csv/a.csv": b"", "pairs.csv/b.csv": b"\n"}, ["query", "document"]),
    ({"pairs.parquet": "no rows"}, ["query", "document", "id"]),
    ({"pairs.parquet/a.parquet": "no rows", "pairs.parquet/b.parquet": "no rows"}, ["query", "document", "id"]),
    ({"shards/a.jsonl": b"", "shards/b.jsonl.gz": gzip.compress(b"\n")}, ["query", "document"]),
    ({"shards/part-0.parquet": "no rows", "shards/_SUCCESS": b""}, ["query", "document", "id"]),
], ids=["empty jsonl", "folder of empty jsonl", "empty csv", "csv header", "folder of empty csv", "parquet",
        "folder of parquet", "folder named without a suffix", "folder of parquet named without a suffix"])
def test_score_ray_of_only_empty_shards_writes_one_parquet_file_of_no_rows(tmp_path, monkeypatch, files,
                                                                          columns) -> None:
    """As without --ray: the columns (the query and document as texts, a CSV header's, a Parquet file's) and
    the score; no Ray cluster is started and no model loaded for no rows."""
    import pyarrow
    import pyarrow.parquet as parquet

    from rerankit.cli import main

    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if data == "no rows":
            parquet.write_table(pyarrow.table({name: pyarrow.array([], pyarrow.string()) for name in columns}),
                                tmp_path / name)
        else:
            (tmp_path / name).write_bytes(data)
    source = tmp_path / next(iter(files)).split("/")[0]
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: pytest.fail("Ray started for no rows"))
    not_a_model = str(tmp_path)  # a folder that exists: loading it would fail

    assert main(["score", "--ray", "--input", str(source), "--output", str(tmp_path / "out"),
                 "--model", not_a_model]) == 0

    assert [path.name for path in (tmp_path / "out").iterdir()] == ["part-0.parquet"]
    table = parquet.read_table(tmp_path / "out")
    assert table.num_rows == 0 and table.column_names == [*columns, "score"]
    assert table.schema.field("score").type == pyarrow.float64()
    if source.is_file():  # the same table as without --ray
        assert main(["score", "--input", str(source), "--output", str(tmp_path / "alone.parquet"),
                     "--model", not_a_model, "--no-progress"]) == 0
        assert parquet.read_table(tmp_path / "alone.parquet").schema.remove_metadata() == \
            table.schema.remove_metadata()


def test_score_ray_still_refuses_a_shard_without_the_columns(cluster, tmp_path, capsys) -> None:
    """A shard of rows without the document column, beside empty ones: the error of a dataset without the column,
    as before; a CSV header without it, or Parquet files of no rows without it, as without --ray (before Ray)."""
    import pyarrow
    import pyarrow.parquet as parquet

    from rerankit.cli import main

    def refused(source: Path, message: str) -> None:
        assert main(["score", "--ray", "--input", str(source), "--output", str(tmp_path / "out")]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]  # not Ray's
        assert len(errors) == 1 and errors[0].startswith("error: document_column: ") and message in errors[0], errors
        assert not (tmp_path / "out").exists()

    _shard(tmp_path / "rows.jsonl" / "a.jsonl", [{"query": "q", "text": "t"}])
    _shard(tmp_path / "rows.jsonl" / "b.jsonl", b"")
    _shard(tmp_path / "rows.jsonl" / "c.jsonl", b"\n\n")
    refused(tmp_path / "rows.jsonl", "the dataset has no column 'document' (its columns: ['query', 'text'])")
    _shard(tmp_path / "header.csv" / "a.csv", _pairs(range(2)))
    _shard(tmp_path / "header.csv" / "b.csv", b"query,text\n")
    refused(tmp_path / "header.csv", "b.csv has no column 'document' (its columns: ['query', 'text'])")
    parquet.write_table(pyarrow.table({"query": pyarrow.array([], pyarrow.string())}), tmp_path / "none.parquet")
    refused(tmp_path / "none.parquet", "the dataset has no column 'document' (its columns: ['query'])")


def test_only_empty_shards_are_left_out_and_only_their_first_bytes_read(tmp_path, monkeypatch) -> None:
    """A row after more blank lines than are read at first is found; a file that cannot be read here (a damaged
    gzip) goes to Ray, which names what is wrong; files Ray leaves out of a folder (hidden, or not JSON) are left
    out as it does."""
    from rerankit.integrations import ray as on_ray

    monkeypatch.setattr(on_ray, "PEEK_BYTES", 16)
    folder = tmp_path / "pairs.jsonl"
    _shard(folder / "late.jsonl", b"\n" * 100 + b'{"query": "q", "document": "d"}\n')
    _shard(folder / "damaged.jsonl.gz", b"not gzip at all")
    _shard(folder / "blank.jsonl", b" \n" * 100)
    _shard(folder / "_SUCCESS", b"")
    _shard(folder / ".part.jsonl.crc", b"")
    _shard(folder / "notes.txt", b"")
    def readable(path: Path) -> tuple:
        extensions = {"jsonl": on_ray._default_extensions(ray.data.read_json), "csv": None}
        return on_ray._readable_shards(resolve_input(str(path), None, extensions), ["query", "document"])

    paths, options, empty = readable(folder)
    assert sorted(Path(path).name for path in paths) == ["damaged.jsonl.gz", "late.jsonl"]
    assert options == {} and empty is None
    assert readable(folder / "late.jsonl") == (str(folder / "late.jsonl"), {}, None)
    header = tmp_path / "pairs.csv"
    _shard(header, b"query,document\n" + b"\n" * 100)  # longer than what is read: left to Ray, which reads no row
    assert readable(header)[2] is None


@pytest.mark.filterwarnings("ignore:The minimum number of concurrent actors")
def test_score_ray_of_no_rows_read_on_ray_still_writes_one_parquet_file(cluster, served_model, tmp_path,
                                                                       monkeypatch) -> None:
    """A CSV header longer than what is read of it before Ray goes to Ray, which reads no row (a dataset of no
    columns) and writes no file: the folder still gets one Parquet file of no rows."""
    import pyarrow.parquet as parquet

    from rerankit.cli import main
    from rerankit.integrations import ray as on_ray

    monkeypatch.setattr(on_ray, "PEEK_BYTES", 4)
    _shard(tmp_path / "pairs.csv", b"query,document\n")
    assert main(["score", "--ray", "--input", str(tmp_path / "pairs.csv"), "--output", str(tmp_path / "out"),
                 "--model", served_model]) == 0
    assert [path.name for path in (tmp_path / "out").iterdir()] == ["part-0.parquet"]
    table = parquet.read_table(tmp_path / "out")
    assert table.num_rows == 0 and table.column_names == ["query", "document", "score"]


def test_score_ray_names_a_shard_without_the_columns_in_one_line_when_others_have_rows(cluster, served_model,
                                                                                         tmp_path, capsys) -> None:
    """A shard without the document column among shards with rows: Ray meets it in a worker, mid-run; the error
    still reaches the user as one line, not behind Ray's traceback."""
    from rerankit.cli import main

    _shard(tmp_path / "mixed.jsonl" / "a.jsonl", _pairs(range(3)))
    _shard(tmp_path / "mixed.jsonl" / "b.jsonl", [{"query": "q", "text": "t"}])
    _shard(tmp_path / "mixed.jsonl" / "c.jsonl", b"")
    code = main(["score", "--ray", "--input", str(tmp_path / "mixed.jsonl"), "--output", str(tmp_path / "out"),
                 "--model", served_model, "--batch-size", "1"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and errors == ["error: document_column: a batch of the dataset has no column 'document' (its "
                                    "columns: ['query', 'text'])"], err[-3000:]


@pytest.mark.parametrize("make", ["empty folder", "no such path"])
def test_score_ray_names_an_input_with_no_file_to_read_in_one_line(cluster, tmp_path, capsys, make) -> None:
    from rerankit.cli import main

    source = tmp_path / "pairs.jsonl"
    if make == "empty folder":
        (source / "_logs").mkdir(parents=True)  # a folder Ray skips, as it skips names beginning with _
    code = main(["score", "--ray", "--input", str(source), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "--input" in errors[0] and "Traceback" not in err, err[-2000:]



def test_score_ray_refuses_a_remote_output_folder_that_is_not_empty(tmp_path, monkeypatch) -> None:
    """``s3://bucket/out`` holding an earlier run's files is refused as a local folder is (Ray would add its files
    beside them), before Ray starts; an empty or new prefix, or one that cannot be listed, is not."""
    import pyarrow.fs

    from rerankit.integrations import ray as ray_integration

    bucket = pyarrow.fs._MockFileSystem()
    bucket.create_dir("bucket/out")
    with bucket.open_output_stream("bucket/out/part-0.parquet") as stream:
        stream.write(b"earlier run")
    with bucket.open_output_stream("bucket/file.parquet") as stream:
        stream.write(b"a file")
    monkeypatch.setattr(ray_integration, "filesystem_of", lambda uri: (bucket, uri.split("://", 1)[1]))
    with pytest.raises(InvalidRequest, match="--output: s3://bucket/out is a folder that is not empty"):
        ray_integration._check_output("s3://bucket/out")
    with pytest.raises(InvalidRequest, match="--output: s3://bucket/file.parquet is a file"):
        ray_integration._check_output("s3://bucket/file.parquet")
    ray_integration._check_output("s3://bucket/new")  # nothing there yet
    monkeypatch.setattr(ray_integration, "filesystem_of", lambda uri: (_ for _ in ()).throw(OSError("no credentials")))
    ray_integration._check_output("s3://bucket/out")  # left to Ray
