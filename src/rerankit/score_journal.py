"""The scores of a ``rerankit score`` run kept as they come, so that an interrupted run goes on where it stopped.

``score_file`` writes its output only once every row is scored (into a temporary file, renamed over the target).
Without a journal, Ctrl-C, a lost server or a full disk after hours of scoring would lose every score. The journal
is a JSON Lines file beside the output (``.<output name>.scored``): a first line naming what is scored (the input
file's path, size and modification time, or stdin; a digest of the texts scored, the columns, the model and a local
model folder's files, the request fields), then one line a backend call with the rows it scored and their scores,
written as each call ends. A run that finds a journal of the same job takes its scores and scores only the other
rows; one of another job (the input changed, another model) is started afresh. The journal is locked while a run
holds it, and removed once the output is written.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

from rerankit.errors import RerankitError

try:
    import fcntl
except ImportError:  # Windows: no lock
    fcntl = None  # type: ignore[assignment]

VERSION = 1


class JournalBusy(RerankitError):
    """Another run of the same command holds the journal."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"--output: another rerankit score is writing it (its journal {path} is locked); wait for "
                         "it or stop it")


class JournalFull(RerankitError):
    """The journal could not be written (a full disk)."""

    def __init__(self, path: Path, kept: int, exc: OSError) -> None:
        super().__init__(f"cannot keep scores in {path}: {exc.strerror or exc}; the {kept} rows scored before are "
                         "kept there: make room and run the same command again")


def journal_path(output: str | Path) -> Path:
    """Where the journal of ``output`` lies: a hidden file beside it."""
    output = Path(output)
    return output.with_name(f".{output.name}.scored")


def pairs_digest(queries: Sequence[str], documents: Sequence[str]) -> str:
    """A digest of the texts scored, row by row: an input replaced by another of the same size and modification
    time (``cp -p``, ``rsync -t``, a restore) is still another job."""
    digest = hashlib.blake2b(digest_size=16)
    for query, document in zip(queries, documents):
        digest.update(b"%d:%d\0" % (len(query), len(document)))
        digest.update(query.encode("utf-8", "surrogatepass"))
        digest.update(document.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def model_files(model: Any) -> list | None:
    """The files of a local model folder (name, size, modification time): a checkpoint saved over the folder's
    files is another model. None for a hub id, a URL or the packaged model."""
    if not isinstance(model, str) or not os.path.isdir(model):
        return None
    found = []
    for folder, _, names in os.walk(model):
        for name in names:
            stat = os.stat(os.path.join(folder, name))
            found.append([os.path.relpath(os.path.join(folder, name), model), stat.st_size, stat.st_mtime_ns])
    return sorted(found)


def job_of(input_path: str | Path, queries: Sequence[str], documents: Sequence[str], model: Any,
           **settings: Any) -> dict:
    """What identifies a scoring job, as JSON values: the input file as it is now (path, size, modification time;
    stdin, ``-``, by its texts alone: rows whose texts are the same get the same scores), a digest of the texts
    scored (``pairs_digest``), the model and a local model folder's files (``model_files``), and ``settings``
    (columns, request fields, engine options)."""
    if str(input_path) == "-":
        source: dict[str, Any] = {"input": "-"}
    else:
        stat = os.stat(input_path)
        source = {"input": str(Path(input_path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    job = {"journal": VERSION, **source, "pairs": pairs_digest(queries, documents), "model": model,
           "model_files": model_files(model), **settings}
    return json.loads(json.dumps(job, default=str))


class ScoreJournal:
    """The journal of one job at ``path``: ``scored`` (row -> score) read back at open, ``record`` for each call.

    The file is locked while open (``JournalBusy`` if another run holds it: two runs of one command would truncate
    and remove each other's journal). A line cut short (a kill or a full disk while writing it) is cut off before
    anything is appended, so that the lines after it stay readable."""

    def __init__(self, path: Path, job: dict, rows: int) -> None:
        self.path = path
        self._file = self._open_locked(path)
        try:
            read = self._read(job, rows)
            self.scored, good_end = read or ({}, 0)
            self.kept = len(self.scored)  # rows whose scores the journal holds
            self._file.seek(good_end)  # the file's offset too: lines are written at it with os.write
            self._file.truncate()  # what follows the last whole line (or a journal of another job) goes
            if not self.scored:
                self._write(job)
        except BaseException:
            self._file.close()
            raise

    @staticmethod
    def _open_locked(path: Path) -> Any:
        """``path`` opened for reading and writing (created, never truncated here) and locked for this process."""
        while True:
            handle = open(os.open(path, os.O_RDWR | os.O_CREAT, 0o666), "r+b")
            if fcntl is None:
                return handle
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                raise JournalBusy(path) from None
            try:
                if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                    return handle
            except FileNotFoundError:
                pass
            handle.close()  # the run that held it finished and removed it meanwhile: open the new one

    def _read(self, job: dict, rows: int) -> tuple[dict[int, float], int] | None:
        """The scores of the journal if it is ``job``'s and the offset after its last whole line, else None. A line
        cut short (the run was killed while writing it) ends the reading; its rows are scored again."""
        scored: dict[int, float] = {}
        self._file.seek(0)
        lines = iter(self._file)
        try:
            header = next(lines, b"")
            if not header.endswith(b"\n") or json.loads(header) != job:
                return None
        except ValueError:
            return None
        good_end = len(header)
        for line in lines:
            if not line.endswith(b"\n"):
                break
            try:
                entry = json.loads(line)
                pairs = list(zip(entry["rows"], entry["scores"], strict=True))
                for row, score in pairs:
                    if type(row) is not int or not 0 <= row < rows:
                        return None
                    scored[row] = math.nan if score is None else float(score)
            except (ValueError, KeyError, TypeError):
                break
            good_end += len(line)
        return scored, good_end

    def _write(self, entry: dict) -> None:
        """One line, written straight to the file (no buffer that a failed write would leave to a later flush)."""
        data = memoryview((json.dumps(entry, allow_nan=False) + "\n").encode())
        fd = self._file.fileno()
        start = os.lseek(fd, 0, os.SEEK_CUR)
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError as exc:  # a full disk: leave no part of the line behind
            try:
                os.ftruncate(fd, start)
                os.lseek(fd, start, os.SEEK_SET)
            except OSError:
                pass
            raise JournalFull(self.path, self.kept, exc) from None

    def record(self, rows: Sequence[int], scores: Sequence[float]) -> None:
        """Keep the scores of ``rows`` (one backend call's)."""
        self._write({"rows": list(rows), "scores": [score if math.isfinite(score) else None for score in scores]})
        self.kept += len(rows)

    def close(self) -> None:
        self._file.close()

    def remove(self) -> None:
        """The output is written: the journal is no longer needed."""
        self.path.unlink(missing_ok=True)  # before the lock goes with close: no other run takes this file meanwhile
        self.close()
