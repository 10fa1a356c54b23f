"""The ``rerankit`` command: ``rank`` documents from a file against a query, or ``serve`` a model over HTTP."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence, TextIO

from rerankit.errors import InvalidRequest, RerankitError
from rerankit.reranker import is_url, make_backend
from rerankit.schema import ScoreRequest, ScoreResponse
from rerankit.server.main import API_KEY_ENV, serve  # fastapi and uvicorn load only when serve() runs

USAGE_ERROR = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0, or 2 with one ``error:`` line on a rerankit error)."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except RerankitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE_ERROR


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``rerankit`` and its subcommands."""
    parser = argparse.ArgumentParser(prog="rerankit", description="Rerank documents by relevance to a query.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    rank = commands.add_parser("rank", help="rank the documents of a file against a query",
                               description="Rank documents against a query, best first.")
    rank.add_argument("--model", help="model path, hub id, or server URL (default: the packaged MiniLM, offline)")
    rank.add_argument("--query", required=True, help="the query text")
    rank.add_argument("--docs", required=True,
                      help="documents: a .txt file (one a line), a .jsonl file, or - for stdin")
    rank.add_argument("--format", choices=("txt", "jsonl"),
                      help="format of --docs (default: from the file suffix; stdin is txt)")
    rank.add_argument("--text-field", default="text", help="the field holding the text in .jsonl (default: text)")
    rank.add_argument("--top-n", type=_positive_int, help="print only the N best")
    rank.add_argument("--json", action="store_true", help="print JSON instead of a table")
    rank.add_argument("--device", help="local model: cpu, cuda, cuda:1, ... (default: the GPU if there is one)")
    rank.add_argument("--dtype", help="local model: float32, bfloat16, float16")
    rank.add_argument("--instruction", help="task instruction, for templates that take one")
    rank.add_argument("--dialect", help="server: its wire dialect, e.g. vllm-generative, cohere (default: discovered)")
    rank.add_argument("--api-key", help=f"server: the API key (default: ${API_KEY_ENV})")
    rank.set_defaults(run=run_rank)

    serve = commands.add_parser("serve", help="serve a model over HTTP (vLLM, SGLang and Cohere routes)",
                                description="Serve one embedded model over HTTP.")
    serve.add_argument("--model", help="model path or hub id (default: the packaged MiniLM); "
                                       "a server URL makes this a proxy")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on (default: 8000)")
    serve.add_argument("--device", help="cpu, cuda, cuda:1, ...")
    serve.add_argument("--dtype", help="float32, bfloat16, float16")
    serve.add_argument("--api-key", help="require this key as a Bearer token (default: $RERANKIT_API_KEY)")
    serve.add_argument("--served-model-name", help="the model name /v1/models and the responses report")
    serve.add_argument("--max-batch-items", type=_positive_int, help="items merged into one engine call at most")
    serve.add_argument("--batch-window-ms", type=_non_negative_float,
                       help="how long a request waits for others to batch with")
    serve.add_argument("--max-items-per-request", type=_positive_int, help="refuse requests with more items")
    serve.add_argument("--max-batch-tokens", type=_positive_int, help="tokens merged into one engine call at most")
    serve.add_argument("--prefix-cache-mib", type=_non_negative_int,
                       help="local model: GPU/CPU memory for the keys and values of long instructions kept across "
                            "requests (default: 1024; 0: none)")
    serve.add_argument("--data-parallel-size", type=_replica_count,
                       help="local model: engine replicas, one process per GPU ('auto': every visible GPU; "
                            "on CPU, N processes share the cores) (default: 1)")
    serve.add_argument("--max-tokens-per-item", type=_positive_int, help="refuse items with more tokens")
    serve.add_argument("--max-queue-requests", type=_positive_int, help="answer 429 when this many requests wait")
    serve.add_argument("--max-body-bytes", type=_positive_int, help="answer 413 to larger request bodies")
    serve.add_argument("--no-batching", dest="batching", action="store_false",
                       help="score one request per engine call (to measure what batching gains)")
    serve.add_argument("--no-warmup", dest="warm_up", action="store_false",
                       help="answer at once instead of first scoring two synthetic requests (compiling, on a GPU)")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    serve.set_defaults(run=run_serve)
    add_score_command(commands)
    return parser


def add_score_command(commands: argparse._SubParsersAction) -> None:
    """``rerankit score``: a table of (query, document) pairs in, the same table with a score column out."""
    score = commands.add_parser("score", help="score a file of (query, document) pairs offline",
                                description="Score every (query, document) row of a .parquet, .jsonl or .csv file "
                                            "and write the rows with a score column.")
    score.add_argument("--input", required=True, help="the pairs: .parquet, .jsonl or .csv")
    score.add_argument("--output", required=True, help="where to write them scored (.parquet, .jsonl or .csv; "
                                                       "with --ray, a folder of Parquet files)")
    score.add_argument("--model", help="model path or hub id (default: the packaged MiniLM)")
    score.add_argument("--query-column", default="query", help="column of the queries (default: query)")
    score.add_argument("--document-column", default="document", help="column of the documents (default: document)")
    score.add_argument("--score-column", default="score", help="column written with the scores (default: score)")
    score.add_argument("--instruction", help="task instruction, for templates that take one")
    score.add_argument("--device", help="cpu, cuda, ... (default: the GPU if there is one)")
    score.add_argument("--dtype", help="float32, bfloat16, float16")
    score.add_argument("--data-parallel-size", type=_replica_count,
                       help="without --ray: engine replicas, one process per GPU ('auto': every visible GPU)")
    score.add_argument("--ray", action="store_true",
                       help="score on a Ray cluster (RAY_ADDRESS, else a local one) with Ray Data")
    score.add_argument("--concurrency", type=_positive_int, default=1, help="with --ray: engine actors (default: 1)")
    score.add_argument("--num-gpus", type=_non_negative_float, default=0.0,
                       help="with --ray: GPUs per engine actor (default: 0)")
    score.add_argument("--batch-size", type=_positive_int, default=4096,
                       help="with --ray: rows per Ray Data batch (default: 4096)")
    score.add_argument("--no-progress", dest="progress", action="store_false", help="without --ray: no progress bar")
    score.set_defaults(run=run_score)


def run_rank(args: argparse.Namespace) -> int:
    """``rerankit rank``: score the documents, print them best first."""
    documents = read_documents(args.docs, args.format, args.text_field)
    backend = make_backend(args.model, **backend_options(args))
    try:
        response = backend.score(ScoreRequest(query=args.query, items=documents, top_n=args.top_n,
                                              instruction=args.instruction))
    finally:
        backend.close()
    if args.json:
        print(json.dumps(ranking_json(args.query, documents, response, args.top_n), ensure_ascii=False, indent=2))
    else:
        print_table(documents, response, args.top_n, sys.stdout)
    return 0


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that configure the backend ``--model`` picks; a flag for the other kind is an error."""
    remote = is_url(args.model)
    refuse_misplaced(args, ("device", "dtype") if remote else ("dialect", "api_key"))
    if remote:
        options = {"dialect": args.dialect, "api_key": args.api_key or os.environ.get(API_KEY_ENV) or None}
    else:
        options = {"device": args.device, "dtype": args.dtype}
    return {name: value for name, value in options.items() if value is not None}


def refuse_misplaced(args: argparse.Namespace, names: Sequence[str]) -> None:
    """``InvalidRequest`` for a flag among ``names`` that is set although ``--model`` is of the other kind."""
    where = "a local model" if is_url(args.model) else "a server URL"
    for name in names:
        if getattr(args, name) is not None:
            raise InvalidRequest(f"--{name.replace('_', '-')}", f"only applies to {where} as --model")


def run_serve(args: argparse.Namespace) -> int:
    """``rerankit serve``: hand the flags to the server (a server URL as --model serves it as a proxy)."""
    if is_url(args.model):
        refuse_misplaced(args, ("device", "dtype", "prefix_cache_mib", "data_parallel_size"))
    kept_bytes = None if args.prefix_cache_mib is None else args.prefix_cache_mib << 20
    serve(args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
          prefix_cache_bytes=kept_bytes, api_key=args.api_key, data_parallel_size=args.data_parallel_size,
          log_level=args.log_level, served_model_name=args.served_model_name, max_batch_items=args.max_batch_items,
          batch_window_ms=args.batch_window_ms, max_items_per_request=args.max_items_per_request,
          max_batch_tokens=args.max_batch_tokens, max_tokens_per_item=args.max_tokens_per_item,
          max_queue_requests=args.max_queue_requests, max_body_bytes=args.max_body_bytes, batching=args.batching,
          warm_up=args.warm_up)
    return 0


def run_score(args: argparse.Namespace) -> int:
    """``rerankit score``: score the file's pairs here (or on Ray with ``--ray``) and write them with their scores."""
    engine = {name: value for name, value in (("device", args.device), ("dtype", args.dtype)) if value is not None}
    columns = {"model": args.model, "query_column": args.query_column, "document_column": args.document_column,
               "score_column": args.score_column,
               "request_fields": {} if args.instruction is None else {"instruction": args.instruction}}
    if args.ray:
        if args.data_parallel_size is not None:
            raise InvalidRequest("--data-parallel-size", "does not apply with --ray: use --concurrency")
        from rerankit.integrations.ray import score_file as score_on_ray

        score_on_ray(args.input, args.output, concurrency=args.concurrency, num_gpus=args.num_gpus,
                     batch_size=args.batch_size, **columns, **engine)
        print(f"wrote {args.output}", file=sys.stderr)
        return 0
    from rerankit.offline import score_file

    if args.data_parallel_size is not None:
        engine["data_parallel_size"] = args.data_parallel_size
    rows = score_file(args.input, args.output, show_progress=args.progress, **columns, **engine)
    print(f"scored {rows} pairs into {args.output}", file=sys.stderr)
    return 0


def read_documents(source: str, file_format: str | None, text_field: str) -> list[str]:
    """The documents of a .txt file (one a line, blank lines skipped), a .jsonl file, or stdin (``-``)."""
    if file_format is None:
        file_format = "jsonl" if source != "-" and Path(source).suffix == ".jsonl" else "txt"
    try:
        # stdin as bytes: its text layer would smuggle bad bytes through as surrogates the tokenizer rejects
        data = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
        text = data.decode("utf-8")
    except OSError as exc:
        raise InvalidRequest("--docs", f"cannot read {source}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise InvalidRequest("--docs", f"{source} is not UTF-8 text (byte {exc.start})") from None
    # "\n" only: splitlines() would also cut at U+2028 or a form feed, which JSON and prose may hold raw
    lines = text.split("\n")
    numbered = [(number, line.strip()) for number, line in enumerate(lines, start=1) if line.strip()]
    if file_format == "jsonl":
        documents = [_jsonl_text(line, number, source, text_field) for number, line in numbered]
    else:
        documents = [line for _, line in numbered]
    if not documents:
        raise InvalidRequest("--docs", f"{source} holds no documents")
    return documents


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _replica_count(text: str) -> int | str:
    return text if text == "auto" else _positive_int(text)


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number, 0 to 65535, got {value}")
    return value


def _jsonl_text(line: str, number: int, source: str, text_field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidRequest("--docs", f"{source} line {number} is not JSON: {exc.msg}") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise InvalidRequest("--docs", f"{source} line {number} has no string field {text_field!r} "
                                       "(choose it with --text-field)")
    return record[text_field]


def ranking_json(query: str, documents: list[str], response: ScoreResponse, top_n: int | None) -> dict[str, Any]:
    """The response as JSON, results best first, each with its rank and text."""
    return {
        "model": response.model,
        "query": query,
        "results": [{"rank": rank, "index": result.index, "score": result.score, "text": documents[result.index]}
                    for rank, result in enumerate(response.ranked(top_n), start=1)],
        "usage": response.usage.model_dump(),
    }


def print_table(documents: list[str], response: ScoreResponse, top_n: int | None, out: TextIO) -> None:
    """One row a document, best first: rank, score, index, and the text cut to the terminal's width."""
    ranked = response.ranked(top_n)
    index_width = max(len("index"), len(str(len(documents) - 1)))
    header = f"{'rank':>4}  {'score':>9}  {'index':>{index_width}}  text"
    text_width = max(20, shutil.get_terminal_size().columns - len(header) + len("text"))
    print(header, file=out)
    for rank, result in enumerate(ranked, start=1):
        print(f"{rank:>4}  {result.score:>9.4f}  {result.index:>{index_width}}  "
              f"{_shorten(documents[result.index], text_width)}", file=out)


def _shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."
