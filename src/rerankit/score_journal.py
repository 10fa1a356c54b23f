"""The scores of a ``rerankit score`` run kept as they come, so that an interrupted run goes on where it stopped.

``score_file`` writes its output only once every row is scored (into a temporary file, renamed over the target).
Without a journal, Ctrl-C, a lost server or a full disk after hours of scoring would lose every score. The journal
is a JSON Lines file beside the output (``.<output name>.scored``): a first line naming what is scored (the input
file's path, size and modification time, the columns, the model and the request fields), then one line a backend
call with the rows it scored and their scores, flushed as each call ends. A run that finds a journal of the same
job takes its scores and scores only the other rows; one of another job (the input changed, another model) is
started afresh. The journal is removed once the output is written.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

VERSION = 1


def journal_path(output: str | Path) -> Path:
    """Where the journal of ``output`` lies: a hidden file beside it."""
    output = Path(output)
    return output.with_name(f".{output.name}.scored")


def job_of(input_path: str | Path, **job: Any) -> dict:
    """What identifies a scoring job: the input file as it is now (path, size, modification time) and ``job``'s
    settings (columns, model, request fields), as JSON values."""
    stat = os.stat(input_path)
    return json.loads(json.dumps({"journal": VERSION, "input": str(Path(input_path).resolve()),
                                  "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, **job}, default=str))


class ScoreJournal:
    """The journal of one job at ``path``: ``scored`` (row -> score) read back at open, ``record`` for each call."""

    def __init__(self, path: Path, job: dict, rows: int) -> None:
        self.path = path
        self.scored: dict[int, float] = {}
        self.restarted = False  # a journal of another job was there and has been replaced
        if path.exists():
            self.scored = self._read(job, rows)
            self.restarted = self.scored is None
            self.scored = self.scored or {}
        self.kept = len(self.scored)  # rows whose scores the journal holds
        mode = "a" if self.scored else "w"
        self._file = path.open(mode, encoding="utf-8")
        if mode == "w":
            self._write(job)

    def _read(self, job: dict, rows: int) -> dict[int, float] | None:
        """The scores of the journal at ``path`` if it is ``job``'s, else None. A line cut short (the run was
        killed while writing it) ends the reading; its rows are scored again."""
        scored: dict[int, float] = {}
        try:
            with self.path.open(encoding="utf-8") as lines:
                if json.loads(next(lines, "null")) != job:
                    return None
                for line in lines:
                    entry = json.loads(line)
                    for row, score in zip(entry["rows"], entry["scores"]):
                        if not 0 <= row < rows:
                            return None
                        scored[row] = math.nan if score is None else float(score)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a cut line (JSONDecodeError is a ValueError): what was read before it stands
        return scored

    def _write(self, entry: dict) -> None:
        self._file.write(json.dumps(entry, allow_nan=False) + "\n")
        self._file.flush()

    def record(self, rows: Sequence[int], scores: Sequence[float]) -> None:
        """Keep the scores of ``rows`` (one backend call's)."""
        self._write({"rows": list(rows), "scores": [score if math.isfinite(score) else None for score in scores]})
        self.kept += len(rows)

    def close(self) -> None:
        self._file.close()

    def remove(self) -> None:
        """The output is written: the journal is no longer needed."""
        self.close()
        self.path.unlink(missing_ok=True)
