"""Ray: rerankit's HTTP server as a Ray Serve deployment, and offline scoring of a Ray Data dataset.

Needs the ``ray`` extra (``pip install 'rerankit[ray]'``); nothing else in rerankit imports Ray.

    serve run rerankit.integrations.ray:app model=Qwen/Qwen3-Reranker-0.6B num_replicas=4 num_gpus=1

``build_app`` gives the same deployment from Python (``serve.run(build_app(...))``); ``score_dataset`` adds a
``score`` column to a dataset of (query, document) rows through an actor pool of engines.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from rerankit.errors import InvalidRequest, RerankitError
from rerankit.offline import offline_backend, score_pairs, text_column
from rerankit.reranker import check_model_source
from rerankit.server.main import API_KEY_ENV

INSTALL = "pip install 'rerankit[ray]'"
DEFAULT_BATCH_ROWS = 4096  # rows a Ray Data batch: a few engine calls, so that an actor's engine stays busy


def _require_ray() -> None:
    try:
        import ray  # noqa: F401
        from ray import data, serve  # noqa: F401
    except ImportError:
        raise RerankitError(f"rerankit.integrations.ray needs Ray Serve and Ray Data: {INSTALL}") from None


class RerankitServer:
    """One Ray Serve replica: an engine (``offline_backend``: ``make_backend`` without progress bars) and rerankit's
    FastAPI app over it (every dialect)."""

    def __init__(self, model: str | None, engine_options: dict[str, Any], server_settings: dict[str, Any]) -> None:
        from rerankit.server.limits import ServerConfig

        self.backend = offline_backend(model, **engine_options)  # as ``rerankit serve``: no progress bars in a log
        self.config = ServerConfig(**server_settings)

    def __serve_build_asgi_app__(self) -> Any:
        """Ray Serve calls this on the replica once the engine is loaded: the app of ``rerankit serve``."""
        from rerankit.server.app import create_app

        return create_app(self.backend, self.config)

    def __del__(self) -> None:
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()


def build_app(model: str | None = None, *, num_replicas: int | str | None = 1,
              ray_actor_options: dict[str, Any] | None = None, autoscaling_config: dict[str, Any] | None = None,
              server_settings: dict[str, Any] | None = None, **engine_options: Any) -> Any:
    """A Ray Serve application serving ``model`` with rerankit's routes, ``num_replicas`` engines (or
    ``autoscaling_config``), each replica with ``ray_actor_options`` (e.g. ``{"num_gpus": 1}``).

    ``server_settings`` are ``ServerConfig`` fields (batching, limits, ``api_key``...); ``engine_options`` go to
    each replica's engine (``device``, ``dtype``, ``data_parallel_size``...). Run it with ``serve.run(app)``.
    """
    _require_ray()
    from ray import serve

    deployment = serve.deployment(serve.ingress()(RerankitServer), name="rerankit")
    deployment = deployment.options(
        num_replicas="auto" if autoscaling_config is not None and num_replicas in (None, 1) else num_replicas,
        ray_actor_options=ray_actor_options or {},
        autoscaling_config=autoscaling_config,
    )
    return deployment.bind(model, engine_options, server_settings or {})


class AppArgs(BaseModel):
    """What ``serve run rerankit.integrations.ray:app key=value ...`` takes."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None
    num_replicas: int = 1
    num_gpus: float = 0
    num_cpus: float = 1
    device: str | None = None
    dtype: str | None = None
    api_key: str | None = None
    max_batch_items: int | None = None
    max_batch_tokens: int | None = None


def app(arguments: dict[str, str]) -> Any:
    """The builder ``serve run rerankit.integrations.ray:app model=... num_replicas=2 num_gpus=1`` calls."""
    try:
        args = AppArgs.model_validate(arguments)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidRequest(".".join(map(str, first["loc"])) or "arguments", first["msg"]) from None
    engine = {name: value for name, value in (("device", args.device), ("dtype", args.dtype)) if value is not None}
    server = {name: value for name, value in (("api_key", args.api_key or os.environ.get(API_KEY_ENV) or None),
                                              ("max_batch_items", args.max_batch_items),
                                              ("max_batch_tokens", args.max_batch_tokens)) if value is not None}
    return build_app(args.model, num_replicas=args.num_replicas,
                     ray_actor_options={"num_gpus": args.num_gpus, "num_cpus": args.num_cpus},
                     server_settings=server, **engine)


class PairScorer:
    """A Ray Data actor: one engine, scoring each batch's rows grouped by query (prefix shared among them)."""

    def __init__(self, model: str | None, query_column: str, document_column: str, score_column: str,
                 engine_options: dict[str, Any], request_fields: dict[str, Any]) -> None:
        self.backend = offline_backend(model, **engine_options)
        self.columns = (query_column, document_column, score_column)
        self.request_fields = request_fields

    def __call__(self, batch: Any) -> Any:
        """The pyarrow ``batch`` with its scores column."""
        from rerankit.offline import with_scores

        query_column, document_column, score_column = self.columns
        queries = text_column(batch, query_column, "query_column", numbered=False)
        documents = text_column(batch, document_column, "document_column", numbered=False)
        return with_scores(batch, score_pairs(self.backend, queries, documents, **self.request_fields), score_column)


def score_dataset(ds: Any, *, query_column: str = "query", document_column: str = "document",
                  model: str | None = None, concurrency: int | tuple[int, int] = 1, num_gpus: float = 0,
                  num_cpus: float | None = None, batch_size: int = DEFAULT_BATCH_ROWS, score_column: str = "score",
                  request_fields: dict[str, Any] | None = None, **engine_options: Any) -> Any:
    """``ds`` (a ``ray.data.Dataset`` of pairs) with a ``score_column``, scored lazily and streamed by an actor pool
    of ``concurrency`` engines (an int, or ``(min, max)`` to autoscale), each holding ``num_gpus`` GPUs.

    Rows of one query within a batch of ``batch_size`` rows are one request (sort ``ds`` by query beforehand to
    share more). ``engine_options`` go to each actor's engine; ``request_fields`` to every ``ScoreRequest``.
    """
    _require_ray()
    for name, value in (("query_column", query_column), ("document_column", document_column)):
        if value not in ds.columns():
            raise InvalidRequest(name, f"the dataset has no column {value!r} (its columns: {ds.columns()})")
    if num_gpus and "device" not in engine_options:
        engine_options["device"] = "cuda"
    return ds.map_batches(
        PairScorer, batch_format="pyarrow", batch_size=batch_size, concurrency=concurrency, num_gpus=num_gpus,
        num_cpus=num_cpus,
        fn_constructor_kwargs={"model": model, "query_column": query_column, "document_column": document_column,
                               "score_column": score_column, "engine_options": engine_options,
                               "request_fields": request_fields or {}},
    )


def score_file(input_path: str, output_path: str, **options: Any) -> None:
    """``rerankit score --ray``: read ``input_path`` (.parquet, .jsonl, .csv) as a Ray dataset on the cluster that
    ``ray.init()`` finds (``RAY_ADDRESS``) or a local one, score it with ``score_dataset(**options)`` and write
    Parquet files into the folder ``output_path``."""
    _require_ray()
    import ray

    readers = {".parquet": ray.data.read_parquet, ".jsonl": ray.data.read_json, ".csv": ray.data.read_csv}
    suffix = os.path.splitext(input_path)[1].lower()  # as without --ray: PAIRS.CSV is CSV
    if suffix not in readers:
        raise InvalidRequest("--input", f"{input_path} must end in one of {', '.join(readers)}")
    if os.path.exists(output_path) and not os.path.isdir(output_path):
        raise InvalidRequest("--output", f"{output_path} is a file: with --ray it names a folder of Parquet files")
    if os.path.isdir(output_path) and os.listdir(output_path):  # Ray appends: a second run would repeat every row
        raise InvalidRequest("--output", f"{output_path} is a folder that is not empty: give a new one")
    check_model_source(options.get("model"))  # here in one line, not in every actor behind Ray's tracebacks
    local = not os.environ.get("RAY_ADDRESS")
    ray.init(ignore_reinit_error=True)
    gpus = options.get("num_gpus") or 0
    if local and gpus > ray.cluster_resources().get("GPU", 0):  # a local cluster never gains one: it would wait
        raise InvalidRequest("--num-gpus", f"asks for {gpus:g} GPU(s) an actor; this machine's Ray cluster has "
                                           f"{ray.cluster_resources().get('GPU', 0):g}")
    try:
        score_dataset(readers[suffix](input_path), **options).write_parquet(output_path)
    except Exception as exc:  # a worker's RerankitError arrives wrapped in Ray's errors, with their tracebacks
        cause = _rerankit_cause(exc)
        if cause is None:
            raise
        raise cause from None


def _rerankit_cause(exc: BaseException) -> RerankitError | None:
    """The ``RerankitError`` that a Ray error wraps (``cause``, ``__cause__``, ``__context__``), if any."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        error = stack.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, RerankitError):
            return error
        stack += [getattr(error, "cause", None), error.__cause__, error.__context__]
    return None
