"""The server's log format: uvicorn's text lines (the default), or one JSON object a line for log collectors.

A JSON line holds ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, the ``request_id`` of the request
being served where there is one (``rerankit.request_ids``: uvicorn's access lines too, which it writes while the
request's response starts), ``trace_id`` and ``span_id`` where the line is written inside a traced request
(``rerankit.tracing``), and ``exception`` (the traceback) where one was logged. An access line also holds
``client``, ``method``, ``path``, ``http_version`` and ``status``.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
from typing import Any

from rerankit import tracing
from rerankit.request_ids import REQUEST_ID

LOG_FORMATS = ("text", "json")
_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")


class JsonFormatter(logging.Formatter):
    """One JSON object a record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = REQUEST_ID.get()
        if request_id is not None:
            line["request_id"] = request_id
        traced = tracing.log_ids()
        if traced is not None:
            line["trace_id"], line["span_id"] = traced
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            line.update(zip(_ACCESS_FIELDS, record.args))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def log_config(level: str, log_format: str = "text") -> dict[str, Any]:
    """uvicorn's logging config with rerankit's own lines (loading, ready, failed requests) in the same format:
    ``log_format`` "text" (uvicorn's) or "json" (``JsonFormatter``, both streams)."""
    from uvicorn.config import LOGGING_CONFIG

    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    logs = copy.deepcopy(LOGGING_CONFIG)
    logs["loggers"]["rerankit"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    if log_format == "json":
        logs["formatters"] = {name: {"()": JsonFormatter} for name in logs["formatters"]}
    return logs
