"""Ray on a local 2-CPU cluster: the Serve deployment answers like ``rerankit serve``; ``score_dataset`` like
``Reranker.score``."""

from __future__ import annotations

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
    """A local Ray cluster of 2 CPUs; its workers import this checkout's rerankit (and the tests' helpers)."""
    source = str(Path(__file__).resolve().parents[2] / "src")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]),
                                       "TOKENIZERS_PARALLELISM": "false"}})
    yield
    ray.shutdown()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_serve_deployment_answers_every_route_like_rerankit_serve(cluster, tiny_bert_cross_encoder) -> None:
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(str(tiny_bert_cross_encoder), num_replicas=1, ray_actor_options={"num_cpus": 0.5},
                            device="cpu"), name="rerankit", route_prefix="/")
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
            for row in range(3000)]
    parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "pairs.parquet")

    assert main(["score", "--ray", "--input", str(tmp_path / "pairs.parquet"), "--output", str(tmp_path / "out"),
                 "--model", str(tiny_bert_cross_encoder), "--device", "cpu", "--batch-size", "1000"]) == 0
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
