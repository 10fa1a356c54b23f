"""``--log-format json``: one JSON object a line, with the request id, for rerankit's own lines and uvicorn's access
lines; the text format stays uvicorn's."""

from __future__ import annotations

import io
import json
import logging
import logging.config

import httpx
import pytest
from live_server import live_server
from server_fakes import RecordingBackend

from rerankit.server.app import create_app
from rerankit.server.logs import log_config

BODY = {"model": "m", "query": "q", "items": ["a", "bb"], "label_token_ids": [1, 2]}


class Lines:
    """The server's log config in JSON with both streams into one buffer, and the lines written there, parsed."""

    def __init__(self) -> None:
        self.buffer = io.StringIO()
        self.config = log_config("info", "json")
        for handler in self.config["handlers"].values():
            handler["stream"] = self.buffer

    def __call__(self) -> list[dict]:
        return [json.loads(line) for line in self.buffer.getvalue().splitlines()]


@pytest.fixture
def json_lines():
    lines = Lines()
    logging.config.dictConfig(lines.config)
    yield lines
    logging.config.dictConfig(log_config("warning"))


def test_json_lines_carry_the_request_id_on_access_and_error_lines(json_lines):
    with live_server(create_app(RecordingBackend()), log_config=json_lines.config, log_level="info") as url:
        ok = httpx.post(f"{url}/generative_scoring", json=BODY, headers={"X-Request-Id": "trace-1"}, timeout=5)
        missing = httpx.get(f"{url}/nowhere", timeout=5)
    assert ok.status_code == 200 and missing.status_code == 404
    lines = json_lines()
    access = [line for line in lines if line["logger"] == "uvicorn.access"]
    scored = next(line for line in access if line["path"] == "/generative_scoring")
    assert scored["request_id"] == "trace-1" and scored["status"] == 200 and scored["method"] == "POST"
    assert scored["level"] == "info" and scored["time"].endswith("+00:00")
    lost = next(line for line in access if line["path"] == "/nowhere")
    assert lost["status"] == 404 and lost["request_id"] == missing.headers["x-request-id"]


def test_an_exception_is_one_json_line_with_its_traceback(json_lines):
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("rerankit.server").exception("scoring request %s failed", "x")
    (line,) = [line for line in json_lines() if line["logger"] == "rerankit.server"]
    assert line["message"] == "scoring request x failed" and line["level"] == "error"
    assert "RuntimeError: boom" in line["exception"] and "request_id" not in line


def test_an_unknown_log_format_is_refused():
    with pytest.raises(ValueError, match="log_format must be one of text, json"):
        log_config("info", "yaml")
