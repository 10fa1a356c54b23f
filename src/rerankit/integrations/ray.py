"""Ray: rerankit's HTTP server as a Ray Serve deployment, and offline scoring of a Ray Data dataset.

Needs the ``ray`` extra (``pip install 'rerankit[ray]'``); nothing else in rerankit imports Ray.

    serve run rerankit.integrations.ray:app model=Qwen/Qwen3-Reranker-0.6B num_replicas=4 num_gpus=1

``build_app`` gives the same deployment from Python (``serve.run(build_app(...))``); ``score_dataset`` adds a
``score`` column to a dataset of (query, document) rows through an actor pool of engines.
"""

from __future__ import annotations

import inspect
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, ValidationError

from rerankit.errors import InvalidRequest, RerankitError
from rerankit.input_paths import Shards, filesystem_of, resolve_input
from rerankit.offline import offline_backend, score_pairs, text_column
from rerankit.reranker import check_model_source
from rerankit.table_files import empty_texts
from rerankit.server.main import API_KEY_ENV

INSTALL = "pip install 'rerankit[ray]'"
DEFAULT_BATCH_ROWS = 4096  # rows a Ray Data batch: a few engine calls, so that an actor's engine stays busy
PEEK_BYTES = 1 << 16  # of a JSONL or CSV shard, read on the driver to tell an empty one (more only while blank)
EMPTY_PART = "part-0.parquet"  # the one file of an output folder whose input has no rows


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
        # a shard's batch may lack a column the dataset's first rows had (Ray checks no schema across shards)
        _check_columns(batch.column_names, query_column, document_column, "a batch of the dataset")
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
    columns = ds.columns()  # None: no row to tell them by (an empty dataset), nothing to check
    if columns is not None:
        _check_columns(columns, query_column, document_column, "the dataset")
    if num_gpus and "device" not in engine_options:
        engine_options["device"] = "cuda"
    return ds.map_batches(
        PairScorer, batch_format="pyarrow", batch_size=batch_size, concurrency=concurrency, num_gpus=num_gpus,
        num_cpus=num_cpus,
        fn_constructor_kwargs={"model": model, "query_column": query_column, "document_column": document_column,
                               "score_column": score_column, "engine_options": engine_options,
                               "request_fields": request_fields or {}},
    )


def score_file(input_path: str, output_path: str, *, file_format: str | None = None, **options: Any) -> None:
    """``rerankit score --ray``: read ``input_path`` (.parquet, .jsonl, .csv: a file, a folder or a glob of them,
    in ``file_format`` where given: ``input_paths.resolve_input``) as a Ray dataset on the cluster that
    ``ray.init()`` finds (``RAY_ADDRESS``) or a local one, score it with ``score_dataset(**options)`` and write
    Parquet files into the folder ``output_path``.

    As without ``--ray``, an empty shard has no rows (``_readable_shards``: an empty JSONL or CSV file is left out
    of the read, as Ray's CSV reader fails on one), and an input with no rows at all gives one Parquet file of no
    rows with its columns and the score column (not read on Ray where every file is empty: no model is loaded)."""
    _require_ray()
    import ray

    readers = {"parquet": ray.data.read_parquet, "jsonl": ray.data.read_json, "csv": ray.data.read_csv}
    _check_output(output_path)
    shards = resolve_input(input_path, file_format,
                           {name: _default_extensions(reader) for name, reader in readers.items()})
    check_model_source(options.get("model"))  # here in one line, not in every actor behind Ray's tracebacks
    columns = [options.get("query_column", "query"), options.get("document_column", "document")]
    score_column = options.get("score_column", "score")
    paths, read_options, empty = _readable_shards(shards, columns)
    if empty is not None:  # every shard empty: nothing for Ray to read or score
        _check_columns(empty.column_names, *columns, "the dataset")
        _write_empty(output_path, empty, score_column)
        return
    local = not os.environ.get("RAY_ADDRESS")
    ray.init(ignore_reinit_error=True)
    gpus = options.get("num_gpus") or 0
    if local and gpus > ray.cluster_resources().get("GPU", 0):  # a local cluster never gains one: it would wait
        raise InvalidRequest("--num-gpus", f"asks for {gpus:g} GPU(s) an actor; this machine's Ray cluster has "
                                           f"{ray.cluster_resources().get('GPU', 0):g}")
    # A worker's RerankitError (a shard without a column) comes back itself, not as Ray's UserCodeException, whose
    # cause this Ray drops: the user reads one line, not a worker's traceback. For this run only: the context is
    # the process's, which a program calling this may use for its own datasets.
    context = ray.data.DataContext.get_current()
    raised_before, context.raise_original_map_exception = context.raise_original_map_exception, True
    try:
        source = readers[shards.format](paths, **read_options)
        score_dataset(source, **options).write_parquet(output_path)
        if not _holds_files(output_path):  # no rows (Parquet files of none): Ray writes no file, not even the folder
            _write_empty(output_path, _empty_table(source, columns), score_column)
    except Exception as exc:  # a worker's RerankitError arrives wrapped in Ray's errors, with their tracebacks
        cause = _rerankit_cause(exc)
        if cause is None:
            raise
        raise cause from None
    finally:
        context.raise_original_map_exception = raised_before


def _rerankit_cause(exc: BaseException) -> RerankitError | None:
    """The ``RerankitError`` that a Ray error wraps (``cause``, ``__cause__``, ``__context__``), if any."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        error = stack.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, RerankitError):  # Ray's RayTaskError(InvalidRequest) is one too: its cause is ours
            inner = getattr(error, "cause", None)
            return inner if isinstance(inner, RerankitError) else error
        stack += [getattr(error, "cause", None), error.__cause__, error.__context__]
    return None


def _check_columns(columns: Sequence[str], query_column: str, document_column: str, where: str) -> None:
    """``InvalidRequest`` naming the argument where ``columns`` (those of ``where``) lack one it names."""
    for name, value in (("query_column", query_column), ("document_column", document_column)):
        if value not in columns:
            raise InvalidRequest(name, f"{where} has no column {value!r} (its columns: {list(columns)})")


def _readable_shards(shards: Shards, columns: Sequence[str]) -> tuple[Any, dict[str, Any], Any]:
    """What Ray's reader should read of ``shards`` (``input_paths.resolve_input``'s): the paths, the reader's
    keyword arguments, and -- where every shard is empty -- the table of no rows they make (else None). The paths
    of ``shards`` where no shard is empty; else its non-empty files.

    A shard is empty as ``rerankit score`` without ``--ray`` reads it (``_shard_kind``): 0 bytes, JSONL of only
    whitespace, CSV of only blank lines or of only its header, Parquet of no rows. Ray's CSV reader fails on an
    empty CSV file, and where every JSONL or CSV file is empty the dataset has no columns; so they are left out.
    A Parquet file of no rows is left to Ray (its columns join the dataset's) unless every one is. A CSV header
    that lacks ``columns`` is refused, as without ``--ray``. Shards that could not be listed here go to Ray as
    given, which names what is wrong."""
    import pyarrow

    files, filesystem = shards.files, shards.filesystem
    if not files:
        return (*shards.reading(), None)
    if shards.format == "parquet":
        return (*shards.reading(), _parquet_without_rows(filesystem, files))
    with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:  # a remote shard: a request or two each
        kinds = list(pool.map(lambda file: _shard_kind(filesystem, file[1], shards.format, columns), files))
    for (name, _), kind in zip(files, kinds):
        if isinstance(kind, pyarrow.Table):
            _check_columns(kind.column_names, *columns, name)
    kept = [info.path for (_, info), kind in zip(files, kinds) if kind is None]
    if len(kept) == len(files):
        return (*shards.reading(), None)
    if not kept:
        headers = [kind for kind in kinds if isinstance(kind, pyarrow.Table)]
        return [], {}, headers[0] if headers else empty_texts(columns)
    return (*shards.reading(kept), None)


def _default_extensions(reader: Any) -> tuple[str, ...] | None:
    """The file extensions (``.jsonl``...) that ``reader`` reads of a folder by default; None: every file."""
    try:
        extensions = inspect.signature(reader).parameters["file_extensions"].default
    except (KeyError, TypeError, ValueError):
        return None
    if not isinstance(extensions, (list, tuple)) or not extensions:
        return None
    return tuple(f".{extension.lstrip('.').lower()}" for extension in extensions)


def _shard_kind(filesystem: Any, info: Any, file_format: str, columns: Sequence[str]) -> Any:
    """None for a JSONL or CSV shard with rows (or one that cannot be read here: Ray reads it, and names what is
    wrong); for an empty one, True, or the table of no rows (its columns) of a CSV file of only its header. Only
    its first bytes are read (decompressed by its name, .gz, .zst..., as Ray reads it), and more only while they
    are blank."""
    import pyarrow
    import pyarrow.csv as csv

    if info.size == 0:
        return True
    blank = b" \t\n\r\x0b\x0c" if file_format == "jsonl" else b"\r\n"  # CSV: pyarrow skips empty lines only
    head, whole = b"", False
    try:
        with filesystem.open_input_stream(info.path, compression="detect") as stream:
            while len(head) < PEEK_BYTES and not (head and file_format == "jsonl"):  # a JSONL row: enough
                chunk = stream.read(PEEK_BYTES)
                if not chunk:
                    whole = True
                    break
                head += chunk if head else chunk.lstrip(blank)
    except (OSError, pyarrow.ArrowException):
        return None
    if not head:
        return True
    if file_format == "jsonl" or not whole:  # CSV longer than PEEK_BYTES: Ray reads it (a long header: no row)
        return None
    try:  # as Ray's reader parses it (its default options); the text columns as texts, as without --ray
        table = csv.read_csv(pyarrow.BufferReader(head), convert_options=csv.ConvertOptions(
            column_types={name: pyarrow.string() for name in columns}))
    except pyarrow.ArrowException:
        return None
    return table if table.num_rows == 0 else None


def _parquet_without_rows(filesystem: Any, files: list[tuple[str, Any]]) -> Any:
    """None where a Parquet file of ``files`` has rows (only footers are read, up to the first such file), else
    the first file's table of no rows (its columns)."""
    import pyarrow
    import pyarrow.parquet as parquet

    try:
        for _, info in files:
            if parquet.read_metadata(info.path, filesystem=filesystem).num_rows:
                return None
        return parquet.read_schema(files[0][1].path, filesystem=filesystem).empty_table()
    except (OSError, pyarrow.ArrowException):
        return None


def _empty_table(ds: Any, columns: Sequence[str]) -> Any:
    """A table of no rows with the columns of the dataset ``ds`` (read from files of no rows)."""
    import pyarrow

    schema = ds.schema()
    base = getattr(schema, "base_schema", None)
    if isinstance(base, pyarrow.Schema):
        return pyarrow.schema([base.field(name) for name in schema.names]).empty_table()
    return empty_texts(columns)


def _write_empty(output_path: str, table: Any, score_column: str) -> None:
    """Write ``table`` (of no rows) with its float ``score_column`` as one Parquet file into the folder
    ``output_path``, as an input of no rows gives without ``--ray``."""
    import pyarrow.parquet as parquet

    from rerankit.offline import with_scores

    try:
        filesystem, folder = filesystem_of(output_path)
        filesystem.create_dir(folder, recursive=True)
        parquet.write_table(with_scores(table, [], score_column), f"{folder.rstrip('/')}/{EMPTY_PART}",
                            filesystem=filesystem)
    except OSError as exc:
        raise InvalidRequest("--output", f"cannot write {output_path}: {exc}") from None


def _check_output(output_path: str) -> None:
    """``InvalidRequest`` naming ``--output`` where ``output_path`` (local or a URI such as ``s3://bucket/out``) is
    a file, or a folder that holds anything: Ray adds its files beside those there, so a second run would repeat
    every row. A path that cannot be listed here (no credentials yet) is left to Ray."""
    import pyarrow.fs

    listed = _output_listing(output_path, recursive=False)
    if listed is None:
        return
    kind, entries = listed
    if kind == pyarrow.fs.FileType.File:
        raise InvalidRequest("--output", f"{output_path} is a file: with --ray it names a folder of Parquet files")
    if entries:
        raise InvalidRequest("--output", f"{output_path} is a folder that is not empty: give a new one")


def _holds_files(output_path: str) -> bool:
    """Whether the folder ``output_path`` exists and holds a file (True where it cannot be told from here: Ray has
    written it)."""
    listed = _output_listing(output_path, recursive=True)
    return listed is None or any(info.is_file for info in listed[1])


def _output_listing(output_path: str, recursive: bool) -> tuple[Any, list[Any]] | None:
    """What ``output_path`` (local or a URI) is (a pyarrow ``FileType``) and, for a folder, its entries (its
    sub-folders' too where ``recursive``); None where it cannot be listed from here (no credentials yet)."""
    import pyarrow
    import pyarrow.fs

    try:
        filesystem, folder = filesystem_of(output_path)
        kind = filesystem.get_file_info(folder).type
        if kind != pyarrow.fs.FileType.Directory:
            return kind, []
        return kind, filesystem.get_file_info(pyarrow.fs.FileSelector(folder, recursive=recursive))
    except (OSError, ValueError, pyarrow.ArrowException):
        return None
