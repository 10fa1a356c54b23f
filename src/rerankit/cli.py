"""The ``rerankit`` command: ``rank`` documents from a file against a query, ``serve`` a model over HTTP, list the
prompt ``templates``, and ``render`` the exact sequences a model scores."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence, TextIO

from rerankit import __version__
from rerankit.errors import InvalidRequest, RerankitError
from rerankit.flag_types import (id_list, non_negative_float, non_negative_int, port, positive_float,
                                 positive_int, replica_count, word_list)
from rerankit.flags_from_env import (ENGINE_PLACEMENT, defaults_from_environment, named_as_set,
                                     settle_serve_environment)
from rerankit.reranker import is_url, make_backend
from rerankit.schema import MODES, ScoreRequest, ScoreResponse
from rerankit.server.limits import RERANK_DIALECTS
from rerankit.server.main import API_KEY_ENV, serve  # fastapi and uvicorn load only when serve() runs
from rerankit.templates import TEMPLATES, Template, get_template, load_template_file, template_matches

USAGE_ERROR = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0, or 2 with one ``error:`` line on a rerankit error)."""
    sys.stderr = sys.stderr or open(os.devnull, "w")  # closed (2>&-): a message would go to stdout, print's fallback
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except RerankitError as exc:  # a flag the environment set is named as its variable
        print(f"error: {named_as_set(str(exc), args)}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:  # Ctrl-C: one line, not the traceback of wherever the engine was
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout left (`rerankit rank ... | head`): stop quietly, as cat does
        try:  # so the flush at exit raises no more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout without a file descriptor
            pass
        return 141


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``rerankit`` and its subcommands."""
    parser = argparse.ArgumentParser(prog="rerankit", description="Rerank documents by relevance to a query.")
    parser.add_argument("--version", action="version", version=f"rerankit {__version__}")
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
    rank.add_argument("--top-n", type=positive_int, help="print only the N best")
    rank.add_argument("--json", action="store_true", help="print JSON instead of a table")
    rank.add_argument("--device", help="local model: cpu, cuda, cuda:1, ... (default: the GPU if there is one)")
    rank.add_argument("--dtype", help="local model: float32, bfloat16, float16, "
                      "fp8 (experimental: decoders and BERT-family encoders on sm_89+ GPUs)")
    add_prompt_flags(rank)
    add_scoring_flags(rank)
    rank.add_argument("--dialect", help="server: its wire dialect, e.g. vllm-generative, cohere (default: discovered)")
    rank.add_argument("--api-key", help=f"server: the API key (default: ${API_KEY_ENV})")
    rank.set_defaults(run=run_rank)

    templates = commands.add_parser("templates", help="list the prompt templates of generative rerankers",
                                    description="List the registered prompt templates.")
    templates.add_argument("--template-file", help="also check and list the template of this .json/.yaml file")
    templates.add_argument("--json", action="store_true", help="print every piece of each template as JSON")
    templates.set_defaults(run=run_templates)

    render = commands.add_parser("render", help="show the exact text and token ids each document is scored on",
                                 description="Show, per document, the sequence(s) the model runs: text, token ids, "
                                             "what truncation cut, and where the score is read.")
    render.add_argument("--model", help="model path or hub id (default: the packaged MiniLM); only its tokenizer "
                                        "and config are loaded")
    render.add_argument("--query", required=True, help="the query text")
    render.add_argument("--docs", required=True, help="documents: a .txt file (one a line), a .jsonl file, or -")
    render.add_argument("--format", choices=("txt", "jsonl"), help="format of --docs (default: from the suffix)")
    render.add_argument("--text-field", default="text", help="the field holding the text in .jsonl (default: text)")
    add_prompt_flags(render)
    add_scoring_flags(render)
    render.add_argument("--json", action="store_true", help="print JSON instead of text")
    render.set_defaults(run=run_render)

    serve = commands.add_parser("serve", help="serve a model over HTTP (vLLM, SGLang and Cohere routes)",
                                description="Serve one embedded model over HTTP.",
                                epilog="Each flag can also be set as RERANKIT_<FLAG> in the environment "
                                       "(--max-batch-items: RERANKIT_MAX_BATCH_ITEMS); the command line wins.")
    serve.add_argument("--model", help="model path or hub id (default: the packaged MiniLM); "
                                       "a server URL makes this a proxy")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=port, default=8000, help="port to listen on (default: 8000)")
    serve.add_argument("--device", help="cpu, cuda, cuda:1, ...")
    serve.add_argument("--dtype", help="float32, bfloat16, float16, fp8 (experimental: decoders and BERT-family "
                             "encoders on sm_89+ GPUs)")
    serve.add_argument("--api-key", action="append",
                       help="require this key as a Bearer token; give it more than once to take any of several "
                            "(rotating a key) (default: $RERANKIT_API_KEY)")
    serve.add_argument("--served-model-name", help="the model name /v1/models and the responses report")
    add_prompt_flags(serve, defaults=True)
    serve.add_argument("--max-batch-items", type=positive_int, help="items merged into one engine call at most")
    serve.add_argument("--batch-window-ms", type=non_negative_float,
                       help="while the engine is busy, how long after its last call ended the next call waits "
                            "for requests to batch with (an idle server sends at once) (default: 5)")
    serve.add_argument("--max-items-per-request", type=positive_int, help="refuse requests with more items")
    serve.add_argument("--max-batch-tokens", type=positive_int, help="tokens merged into one engine call at most")
    serve.add_argument("--prefix-cache-mib", type=non_negative_int,
                       help="local model: GPU/CPU memory for the keys and values of long instructions kept across "
                            "requests (default: 1024; 0: none)")
    serve.add_argument("--data-parallel-size", type=replica_count,
                       help="local model: engine replicas, one process per GPU ('auto': every visible GPU; "
                            "on CPU, N processes share the cores) (default: 1)")
    serve.add_argument("--replica-timeout", type=positive_float, metavar="S",
                       help="with --data-parallel-size: a replica that holds work and sends nothing for S seconds "
                            "(a hung process or device) is killed and restarted, its work retried on another "
                            "(default: off; one call may run for minutes)")
    serve.add_argument("--startup-timeout", type=positive_float, metavar="S",
                       help="with --data-parallel-size: seconds a replica may take to load its model, at start and "
                            "after a restart, before it counts as failed (default: 600)")
    serve.add_argument("--max-tokens-per-item", type=positive_int,
                       help="cut items to this many tokens; refuse them where the request asks for no cut "
                            "(default: 8192)")
    serve.add_argument("--max-queue-requests", type=positive_int, help="answer 429 when this many requests wait")
    serve.add_argument("--max-body-bytes", type=positive_int, help="answer 413 to larger request bodies")
    serve.add_argument("--rerank-dialect", choices=RERANK_DIALECTS,
                       help="the dialect answering a rerank body that shows none (bare query and documents) on the "
                            "paths that speak it (default: vllm-rerank on /rerank and /v1/rerank, cohere on "
                            "/v2/rerank)")
    serve.add_argument("--max-request-tokens", type=positive_int,
                       help="answer 413 to requests of more estimated tokens, after truncation (default: 262144)")
    serve.add_argument("--drain-seconds", type=non_negative_float,
                       help="on SIGTERM/SIGINT, time given to work in progress before it is answered 503 (default: 10)")
    serve.add_argument("--max-connections", type=positive_int,
                       help="open connections at most; one more is answered 503 and closed (default: 1024)")
    serve.add_argument("--header-timeout", type=positive_float, dest="header_timeout_s",
                       help="seconds a connection has to send a request's headers (over HTTPS, its TLS handshake "
                            "included), else it is closed (default: 10)")
    serve.add_argument("--body-timeout", type=positive_float, dest="body_timeout_s",
                       help="seconds a request's body has to arrive whole once its headers are in, else 408 and the "
                            "connection is closed (default: 30)")
    serve.add_argument("--timeout-keep-alive", type=non_negative_float, dest="keep_alive_timeout_s",
                       help="seconds an idle keep-alive connection stays open (default: 5)")
    serve.add_argument("--no-batching", dest="batching", action="store_false",
                       help="score one request per engine call (to measure what batching gains)")
    serve.add_argument("--no-warmup", dest="warm_up", action="store_false",
                       help="answer at once instead of first running every batch shape the server forms "
                            "(compiling and capturing them, on a GPU)")
    serve.add_argument("--ssl-certfile", help="serve HTTPS with this PEM certificate (chain)")
    serve.add_argument("--ssl-keyfile", help="with --ssl-certfile: its PEM private key (default: in the certfile)")
    serve.add_argument("--ssl-keyfile-password", help="with --ssl-keyfile: the key's password")
    serve.add_argument("--ssl-ca-certs", help="with --ssl-certfile: require client certificates signed by these "
                                              "PEM CAs (mutual TLS)")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    serve.add_argument("--log-format", default="text", choices=("text", "json"),
                       help="text lines (default), or one JSON object a line with the request id, for log "
                            "collectors")
    serve.add_argument("--caller-header",
                       help="the request header that names its caller (e.g. X-Tenant-Id, set by your gateway) for "
                            "the fair shares between callers (default: the API key given where there are several, "
                            "else the client's address)")
    serve.add_argument("--otlp-traces-endpoint", "--otlp-endpoint", dest="otlp_traces_endpoint",
                       help="send OpenTelemetry traces to this OTLP collector, e.g. http://localhost:4318 (HTTP) or "
                            "http://localhost:4317 (gRPC); needs the otel extra (default: no traces)")
    serve.add_argument("--otlp-service-name",
                       help="with --otlp-traces-endpoint: the service name of the spans (default: "
                            "$OTEL_SERVICE_NAME, else rerankit)")
    defaults_from_environment(serve)  # unwrapped, and a bad value reported, in run_serve (settle_serve_environment)
    serve.set_defaults(run=run_serve)
    add_score_command(commands)
    return parser


def add_prompt_flags(parser: argparse.ArgumentParser, defaults: bool = False) -> None:
    """--template/--template-file, --mode and --instruction: per request, or the served model's ``defaults``."""
    scope = "the default for every request: " if defaults else ""
    parser.add_argument("--template", help=f"{scope}prompt template: a registered name (see `rerankit templates`) "
                                           "or a .json/.yaml file of its pieces (default: detected from the model)")
    parser.add_argument("--template-file", help=f"{scope}prompt template from a .json/.yaml file of its pieces")
    parser.add_argument("--mode", choices=MODES, help=f"{scope}scoring mode (default: the model's first)")
    parser.add_argument("--instruction", help=f"{scope}task instruction, for templates that take one")


def add_scoring_flags(parser: argparse.ArgumentParser) -> None:
    """Label and length flags of one scoring request (``rank`` and ``render``)."""
    parser.add_argument("--labels", type=word_list,
                        help="generative: label words, the positive first, e.g. yes,no (default: the template's)")
    parser.add_argument("--label-token-ids", type=id_list,
                        help="generative: label token ids, the positive first, e.g. 9693,2152 (raw scoring on a "
                             "server without a template)")
    parser.add_argument("--max-tokens-per-item", type=positive_int, help="cut each document to N tokens")
    parser.add_argument("--truncation", choices=("end", "start", "none"),
                        help="cut a long document's end (default) or start, or refuse it (none)")
    parser.add_argument("--long-documents", choices=("truncate", "max", "mean"),
                        help="a document longer than the model takes: truncate it (default), or score it in "
                             "windows and keep their max or mean")
    parser.add_argument("--window-tokens", type=positive_int,
                        help="with --long-documents: document tokens per window (default: all that fit)")
    parser.add_argument("--window-stride", type=positive_int,
                        help="with --long-documents: tokens between window starts (default: 3/4 of a window)")
    parser.add_argument("--max-windows", type=positive_int, help="with --long-documents: windows per document "
                                                                   "at most")


def chosen_template(args: argparse.Namespace) -> str | Template | None:
    """The template of --template (a name, or a file when it names one) or --template-file, checked now."""
    if args.template is not None and args.template_file is not None:
        raise InvalidRequest("--template-file", "give --template or --template-file, not both")
    if args.template_file is not None:
        return load_template_file(args.template_file)
    if args.template is None:
        return None
    if args.template in TEMPLATES:
        return args.template
    if Path(args.template).suffix.lower() in (".json", ".yaml", ".yml") or Path(args.template).is_file():
        return load_template_file(args.template)
    return get_template(args.template).name  # an unknown name: InvalidRequest listing the known ones


def scoring_request(args: argparse.Namespace, documents: list[str]) -> ScoreRequest:
    """The ``ScoreRequest`` that ``rank`` and ``render`` send; unset flags keep the schema's defaults."""
    fields = {"template": chosen_template(args), "mode": args.mode, "instruction": args.instruction,
              "labels": args.labels, "label_token_ids": args.label_token_ids,
              "max_tokens_per_item": args.max_tokens_per_item, "truncation": args.truncation,
              "long_documents": args.long_documents, "long_document_window": args.window_tokens,
              "long_document_stride": args.window_stride, "long_document_max_windows": args.max_windows,
              "top_n": getattr(args, "top_n", None)}
    return ScoreRequest(query=args.query, items=documents,
                        **{name: value for name, value in fields.items() if value is not None})


def add_score_command(commands: argparse._SubParsersAction) -> None:
    """``rerankit score``: a table of (query, document) pairs in, the same table with a score column out."""
    score = commands.add_parser("score", help="score a file of (query, document) pairs offline",
                                description="Score every (query, document) row of a .parquet, .jsonl or .csv file "
                                            "(.jsonl.gz, .csv.gz: gzipped; -: stdin) and write the rows with a "
                                            "score column.")
    score.add_argument("--input", required=True, help="the pairs: .parquet, .jsonl, .csv, .jsonl.gz, .csv.gz, - for "
                                                      "stdin (with --format), or with --ray a folder or glob of them")
    score.add_argument("--output", required=True, help="where to write them scored (the same suffixes, or - for "
                                                       "stdout; with --ray, a folder of Parquet files)")
    score.add_argument("--format", choices=("jsonl", "csv", "parquet"),
                       help="the format of - as --input or --output (default for stdout: the input's), or with "
                            "--ray of --input's files (default: their suffixes)")
    score.add_argument("--model", help="model path, hub id or server URL (default: the packaged MiniLM)")
    score.add_argument("--query-column", default="query", help="column of the queries (default: query)")
    score.add_argument("--document-column", default="document", help="column of the documents (default: document)")
    score.add_argument("--score-column", default="score", help="column written with the scores (default: score)")
    score.add_argument("--instruction", help="task instruction, for templates that take one")
    score.add_argument("--device", help="cpu, cuda, ... (default: the GPU if there is one)")
    score.add_argument("--dtype", help="float32, bfloat16, float16, fp8 (experimental: decoders and BERT-family "
                             "encoders on sm_89+ GPUs)")
    score.add_argument("--data-parallel-size", type=replica_count,
                       help="without --ray: engine replicas, one process per GPU ('auto': every visible GPU)")
    score.add_argument("--ray", action="store_true",
                       help="score on a Ray cluster (RAY_ADDRESS, else a local one) with Ray Data")
    score.add_argument("--concurrency", type=positive_int, help="with --ray: engine actors (default: 1)")
    score.add_argument("--num-gpus", type=non_negative_float, help="with --ray: GPUs per engine actor (default: 0)")
    score.add_argument("--batch-size", type=positive_int,
                       help="with --ray: rows per Ray Data batch (default: 4096)")
    score.add_argument("--no-progress", dest="progress", action="store_false", help="without --ray: no progress bar")
    score.set_defaults(run=run_score)


def run_rank(args: argparse.Namespace) -> int:
    """``rerankit rank``: score the documents, print them best first."""
    documents = read_documents(args.docs, args.format, args.text_field)
    request = scoring_request(args, documents)  # bad flags fail here, before a model loads
    backend = make_backend(args.model, **backend_options(args))
    try:
        response = backend.score(request)
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


def refuse_misplaced(args: argparse.Namespace, names: Sequence[str], variables: dict[str, str] | None = None) -> None:
    """``InvalidRequest`` for a flag among ``names`` that is set although ``--model`` is of the other kind, named as
    its environment variable where ``variables`` (``from_environment``) has it."""
    where = "a local model" if is_url(args.model) else "a server URL"
    for name in names:
        if getattr(args, name) is not None:
            flag = f"${variables[name]}" if variables and name in variables else f"--{name.replace('_', '-')}"
            raise InvalidRequest(flag, f"only applies to {where} as --model")


def run_templates(args: argparse.Namespace) -> int:
    """``rerankit templates``: one line a template (name, the model families it is detected for, labels)."""
    templates = dict(TEMPLATES)
    if args.template_file is not None:
        extra = load_template_file(args.template_file)
        templates[extra.name] = extra
    if args.json:
        print(json.dumps([{**dataclasses.asdict(template), "matches": template_matches(name)}
                          for name, template in templates.items()], ensure_ascii=False, indent=2))
        return 0
    rows = [(name, ", ".join(template_matches(name)) or "-", ",".join(template.labels) or "(label_token_ids)")
            for name, template in templates.items()]
    widths = [max(len(row[column]) for row in rows + [("name", "models", "labels")]) for column in range(2)]
    for name, models, labels in [("name", "models", "labels"), *rows]:
        print(f"{name:<{widths[0]}}  {models:<{widths[1]}}  {labels}")
    return 0


def run_render(args: argparse.Namespace) -> int:
    """``rerankit render``: encode the request as the engine would and print each document's sequences."""
    documents = read_documents(args.docs, args.format, args.text_field)
    request = scoring_request(args, documents)
    if is_url(args.model):
        raise InvalidRequest("--model", "render needs a local model or hub id (its tokenizer), not a server URL")
    from rerankit.defaults import default_model_path
    from rerankit.engine.load import load_model
    from rerankit.engine.render import render_request

    rendering = render_request(request, load_model(args.model or default_model_path(), weights=False))
    if args.json:
        print(json.dumps(rendering.to_dict(), ensure_ascii=False, indent=2))
    else:
        print_rendering(rendering, sys.stdout)
    return 0


def print_rendering(rendering: Any, out: TextIO) -> None:
    """The rendering as text: a header (mode, template, labels), then each document's sequences."""
    labels = ", ".join(f"{label['token']!r}={label['id']}" for label in rendering.labels) or "-"
    print(f"model: {rendering.model}\nmode: {rendering.mode}   template: {rendering.template or '-'}   "
          f"labels (positive first): {labels}", file=out)
    if rendering.instruction is not None:
        print(f"instruction: {rendering.instruction}", file=out)
    if rendering.query is not None:
        _print_sequence("query", rendering.query, out)
    for item in rendering.items:
        cut = "scored in windows" if item.cut_tokens is None else f"truncation cut {item.cut_tokens} tokens"
        print(f"\n=== document {item.index}: {item.document_tokens} tokens, {cut}, "
              f"{len(item.sequences)} sequence(s)", file=out)
        for number, sequence in enumerate(item.sequences):
            _print_sequence(f"window {number}" if len(item.sequences) > 1 else "sequence", sequence, out)


def _print_sequence(title: str, sequence: Any, out: TextIO) -> None:
    read = ("mean of every token's state" if sequence.read_position is None
            else f"position {sequence.read_position} (token {sequence.read_token!r})")
    print(f"--- {title}: {sequence.tokens} tokens, score read at {read}", file=out)
    print(sequence.text, file=out)
    print(f"ids: {sequence.token_ids}", file=out)


def run_serve(args: argparse.Namespace) -> int:
    """``rerankit serve``: hand the flags to the server (a server URL as --model serves it as a proxy)."""
    variables = settle_serve_environment(args, is_url)  # the flags the environment set: their variables
    if any(not key.strip() for key in args.api_key or ()):  # an unset secret ("$KEY") must not open the server
        raise InvalidRequest("--api-key", "is empty: give the key (or leave the flag out to serve without one)")
    if is_url(args.model):  # a prompt default would change the scores, which a proxy cannot do: refused
        refuse_misplaced(args, (*ENGINE_PLACEMENT, "template", "template_file", "mode", "instruction"), variables)
    for flag in ("replica_timeout", "startup_timeout"):
        if getattr(args, flag) is not None and args.data_parallel_size in (None, 1):
            raise InvalidRequest(f"--{flag.replace('_', '-')}", "applies to engine replicas: give "
                                                                 "--data-parallel-size too")
    kept_bytes = None if args.prefix_cache_mib is None else args.prefix_cache_mib << 20
    defaults = {"template": chosen_template(args), "mode": args.mode, "instruction": args.instruction,
                "replica_timeout_s": args.replica_timeout, "startup_timeout_s": args.startup_timeout}
    serve(args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
          prefix_cache_bytes=kept_bytes, api_key=args.api_key, data_parallel_size=args.data_parallel_size,
          engine_options={name: value for name, value in defaults.items() if value is not None},
          log_level=args.log_level, log_format=args.log_format, served_model_name=args.served_model_name,
          max_batch_items=args.max_batch_items,
          batch_window_ms=args.batch_window_ms, max_items_per_request=args.max_items_per_request,
          max_batch_tokens=args.max_batch_tokens, max_tokens_per_item=args.max_tokens_per_item,
          max_queue_requests=args.max_queue_requests, max_body_bytes=args.max_body_bytes, batching=args.batching,
          warm_up=args.warm_up, rerank_dialect=args.rerank_dialect, max_request_tokens=args.max_request_tokens,
          drain_seconds=args.drain_seconds, max_connections=args.max_connections, caller_header=args.caller_header,
          header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
          keep_alive_timeout_s=args.keep_alive_timeout_s, ssl_certfile=args.ssl_certfile,
          ssl_keyfile=args.ssl_keyfile, ssl_keyfile_password=args.ssl_keyfile_password,
          ssl_ca_certs=args.ssl_ca_certs, otlp_traces_endpoint=args.otlp_traces_endpoint,
          otlp_service_name=args.otlp_service_name)
    return 0


def run_score(args: argparse.Namespace) -> int:
    """``rerankit score``: score the file's pairs here (or on Ray with ``--ray``, or on the server ``--model``
    names) and write them with their scores."""
    if is_url(args.model):
        refuse_misplaced(args, ("device", "dtype", "data_parallel_size"))
    engine = {name: value for name, value in (("device", args.device), ("dtype", args.dtype),
                                              ("data_parallel_size", args.data_parallel_size)) if value is not None}
    columns = {"model": args.model, "query_column": args.query_column, "document_column": args.document_column,
               "score_column": args.score_column,
               "request_fields": {} if args.instruction is None else {"instruction": args.instruction}}
    if args.ray:
        if args.data_parallel_size is not None:
            raise InvalidRequest("--data-parallel-size", "does not apply with --ray: use --concurrency")
        if "-" in (args.input, args.output):
            raise InvalidRequest("--input" if args.input == "-" else "--output",
                                 "with --ray, --input and --output name files (no stdin or stdout)")
        from rerankit.integrations.ray import score_file as score_on_ray

        ray = {name: value for name, value in (("concurrency", args.concurrency), ("num_gpus", args.num_gpus),
                                               ("batch_size", args.batch_size)) if value is not None}
        score_on_ray(args.input, args.output, file_format=args.format, **ray, **columns, **engine)
        print(f"wrote {args.output}", file=sys.stderr)
        return 0
    for name in ("concurrency", "num_gpus", "batch_size"):
        if getattr(args, name) is not None:
            raise InvalidRequest(f"--{name.replace('_', '-')}", "only applies with --ray")
    from rerankit.offline import score_file

    rows = score_file(args.input, args.output, show_progress=args.progress, file_format=args.format, **columns,
                      **engine)
    print(f"scored {rows} pairs into {'stdout' if args.output == '-' else args.output}", file=sys.stderr)
    return 0


def read_documents(source: str, file_format: str | None, text_field: str) -> list[str]:
    """The documents of a .txt file (one a line, blank lines skipped), a .jsonl file, or stdin (``-``)."""
    if file_format is None:
        file_format = "jsonl" if source != "-" and Path(source).suffix.lower() == ".jsonl" else "txt"
    try:
        # stdin as bytes: its text layer would smuggle bad bytes through as surrogates the tokenizer rejects
        data = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
        text = data.decode("utf-8-sig")  # a byte order mark (Windows editors write one) is not the first document's
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
