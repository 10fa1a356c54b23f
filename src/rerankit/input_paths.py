"""What ``rerankit score --ray`` reads of ``--input``: a file, a folder of shards, or a glob of them, local or a URI
(``s3://bucket/pairs/part-*.parquet``), and in which format.

The format is ``--format``'s, else the one the name given ends in (``pairs.jsonl/``, ``data/*.csv``), else the one
every file found ends in (a folder ``shards/`` of ``part-0.parquet`` files). Ray's readers take no glob: the files
one matches are listed here, with pyarrow's filesystems. Names beginning with ``.`` or ``_`` (``_SUCCESS``,
``.part-0.crc``, ``_temporary/``) are left out of a folder or a glob, as Ray and Spark leave them out of a folder.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rerankit.errors import InvalidRequest
from rerankit.table_files import FORMATS, STDIO, SUFFIXES

GLOB_CHARACTERS = "*?["
HIDDEN = (".", "_")  # beginnings of the names a folder's listing leaves out
EXAMPLES = 2  # file names an error shows of each kind it found


@dataclass(frozen=True)
class Shards:
    """The input resolved: its ``format``; ``paths`` for Ray's reader (the input as given, or the files a glob
    matched); the files found, each as (its name for an error, its pyarrow ``FileInfo``), or None where the input
    could not be listed here (Ray reads it as given and names what is wrong); their ``filesystem``; and whether
    every file is read whatever its suffix (``--format``)."""

    format: str
    paths: str | list[str]
    files: list[tuple[str, Any]] | None
    filesystem: Any = None
    every_file: bool = False

    def reading(self, paths: str | list[str] | None = None) -> tuple[str | list[str], dict[str, Any]]:
        """What Ray's reader reads (``paths``, some of the files; else ``self.paths``) and its keyword arguments:
        the ``filesystem`` of files listed on a remote one (their paths have no scheme), no extension filter with
        ``--format``."""
        import pyarrow.fs

        paths = self.paths if paths is None else paths
        options: dict[str, Any] = {"file_extensions": None} if self.every_file else {}
        if isinstance(paths, list) and not isinstance(self.filesystem, pyarrow.fs.LocalFileSystem):
            options["filesystem"] = self.filesystem
        return paths, options


def suffix_format(name: str) -> str | None:
    """The format that the suffix of ``name`` (a file, a folder or a glob) tells, as ``rerankit score`` reads a
    file (``.jsonl.gz``: jsonl; any case); None where it tells none."""
    lowered = name.rstrip("/").lower()
    suffix = next((suffix for suffix in SUFFIXES if lowered.endswith(suffix)), None)
    return None if suffix is None else suffix[1:].split(".")[0]


def is_glob(path: str) -> bool:
    """Whether ``path`` holds a glob's special characters (``*``, ``?``, ``[``)."""
    return any(character in path for character in GLOB_CHARACTERS)


def check_one_file(path: str) -> None:
    """``InvalidRequest`` naming ``--input`` where ``path`` is a folder or a glob (``score`` without ``--ray``
    reads one file)."""
    if path == STDIO:
        return
    kind = "a folder" if os.path.isdir(path) else "a glob" if is_glob(path) and not os.path.exists(path) else None
    if kind is not None:
        raise InvalidRequest("--input", f"{path} is {kind}: without --ray, --input names one file (with --ray, a "
                                        "folder or a glob of shards)")


def filesystem_of(path: str) -> tuple[Any, str]:
    """The pyarrow filesystem of ``path`` (a URI such as ``s3://bucket/pairs``, or a local path) and the path on
    it."""
    import pyarrow.fs

    if "://" in path:
        return pyarrow.fs.FileSystem.from_uri(path)
    return pyarrow.fs.LocalFileSystem(), os.path.abspath(path)


def resolve_input(input_path: str, file_format: str | None,
                  extensions: Mapping[str, tuple[str, ...] | None]) -> Shards:
    """The shards of ``input_path`` and their format (``file_format``, else as the module tells).

    ``extensions`` (format -> the suffixes Ray's reader of it reads of a folder, None: every file) picks the files
    of a folder whose name tells the format; with ``file_format`` every file is read, and where the files tell it
    every file must end in one known format. ``InvalidRequest`` naming ``--input`` for a glob matching no file, a
    folder with none, a local path that does not exist, files of no known format or of several."""
    import pyarrow
    import pyarrow.fs

    named, every_file = file_format or suffix_format(input_path), file_format is not None
    try:
        filesystem, root, rest = _located(input_path)
        found = filesystem.get_file_info(f"{root.rstrip('/')}/{rest}" if rest else root)  # a name holding a *
        globbed = found.type == pyarrow.fs.FileType.NotFound and bool(rest)
        if globbed:
            entries = _matches(filesystem, root, rest, input_path[:len(input_path) - len(rest)])
        else:
            entries = [] if found.type == pyarrow.fs.FileType.NotFound else [(input_path, found)]
    except (OSError, ValueError, pyarrow.ArrowException) as exc:
        if named is None or is_glob(input_path):  # Ray would read neither
            raise InvalidRequest("--input", f"cannot list {input_path}: {exc}") from None
        return Shards(named, input_path, None, every_file=every_file)
    if not entries and not globbed:
        if named is not None and not isinstance(filesystem, pyarrow.fs.LocalFileSystem):
            return Shards(named, input_path, None, every_file=every_file)  # as before: Ray names it
        raise InvalidRequest("--input", f"{input_path}: no such file or folder")
    if named is None and not globbed and found.type == pyarrow.fs.FileType.File:
        raise InvalidRequest("--input", f"{input_path} must end in one of {', '.join(SUFFIXES)} (or give --format)")
    folder_extensions = None if every_file or named is None else extensions.get(named)
    files: list[tuple[str, Any]] = []
    for name, info in entries:
        if info.type == pyarrow.fs.FileType.Directory:
            files += _folder_files(filesystem, info.path, name, folder_extensions)
        elif info.type == pyarrow.fs.FileType.File:
            files.append((name, info))
    files = list({info.path: (name, info) for name, info in files}.values())  # "data/**": a folder and its files
    if not files:
        what = f"{named} file" if named else "file"
        raise InvalidRequest("--input", f"{input_path} matches no {what}" if globbed
                             else f"{input_path} is a folder with no {what} in it")
    paths = [info.path for _, info in files] if globbed else input_path
    return Shards(named or _one_format(input_path, files), paths, files, filesystem, every_file)


def _folder_files(filesystem: Any, root: str, name: str,
                  extensions: tuple[str, ...] | None) -> list[tuple[str, Any]]:
    """The files of the folder ``root`` (``name`` as given), as Ray's reader lists them: at any depth but those
    under a name beginning with ``.`` or ``_``, ending in one of ``extensions`` (None: every file), by path."""
    return [(os.path.join(name, relative), info) for relative, info in _listing(filesystem, root, recursive=True)
            if info.is_file and not relative.startswith(HIDDEN)
            and (extensions is None or info.path.lower().endswith(extensions))]


def _listing(filesystem: Any, root: str, recursive: bool, allow_not_found: bool = False) -> list[tuple[str, Any]]:
    """The entries of the folder ``root`` on ``filesystem`` (its sub-folders' too where ``recursive``), by path, each
    as (its path relative to ``root``, its ``FileInfo``)."""
    import pyarrow.fs

    base = root.rstrip("/")
    selector = pyarrow.fs.FileSelector(root, allow_not_found=allow_not_found, recursive=recursive)
    return [(info.path[len(base):].lstrip("/"), info)
            for info in sorted(filesystem.get_file_info(selector), key=lambda info: info.path)
            if info.path.startswith(base)]


def _located(input_path: str) -> tuple[Any, str, str]:
    """The filesystem of ``input_path``, the path on it of its part before the first name with a glob's special
    character (the whole path where none has one), and the glob after it (else ""). A URI is parsed without the
    glob: ``?`` would begin its query, and ``[`` is no URI character."""
    if not is_glob(input_path):
        return (*filesystem_of(input_path), "")
    prefix, rest = _split_glob(input_path)
    return (*filesystem_of(prefix or ("/" if input_path.startswith("/") else ".")), rest)


def _split_glob(pattern: str) -> tuple[str, str]:
    """``pattern``'s names before its first name with a glob's special character, and those from it on."""
    segments = pattern.split("/")
    first = next(index for index, segment in enumerate(segments) if is_glob(segment))
    return "/".join(segments[:first]), "/".join(segments[first:])


def _matches(filesystem: Any, root: str, rest: str, prefix: str) -> list[tuple[str, Any]]:
    """The files and folders that the glob ``rest`` matches within the folder ``root`` on ``filesystem`` (given as
    ``prefix``, ``data/``), each as (its name for an error, its ``FileInfo``), by path: ``*`` and ``?`` within a name,
    ``**`` across folders, ``[...]`` a character of a set; none under a name beginning with ``.`` or ``_``."""
    regex = re.compile(_glob_regex(rest))
    listed = _listing(filesystem, root, recursive="/" in rest or "**" in rest, allow_not_found=True)
    return [(prefix + relative, info) for relative, info in listed
            if regex.fullmatch(relative) and not any(part.startswith(HIDDEN) for part in relative.split("/"))]


def _glob_regex(pattern: str) -> str:
    """The regular expression of the glob ``pattern`` (``/`` between names; ``**/``: any folders, or none)."""
    out, index = [], 0
    while index < len(pattern):
        if pattern.startswith("**/", index):
            out.append("(?:.*/)?")
            index += 3
        elif pattern.startswith("**", index):
            out.append(".*")
            index += 2
        elif pattern[index] in "*?":
            out.append("[^/]*" if pattern[index] == "*" else "[^/]")
            index += 1
        elif pattern[index] == "[" and (end := pattern.find("]", index + 2)) != -1:
            chars = pattern[index + 1:end]
            negate = chars.startswith("!")
            kept = re.sub(r"([][\\^])", r"\\\1", chars[negate:])  # a range (a-z) stays one
            out.append(f"[{'^' if negate else ''}{kept}]")
            index = end + 1
        else:
            out.append(re.escape(pattern[index]))
            index += 1
    return "".join(out)


def _one_format(input_path: str, files: Sequence[tuple[str, Any]]) -> str:
    """The one format that the suffixes of ``files`` tell; ``InvalidRequest`` naming what was found where a file
    ends in none (``.json``, no suffix) or they tell several."""
    kinds: dict[str, list[str]] = {}  # a format (.jsonl), or the suffix of a file of none (.json, no suffix)
    for name, _ in files:
        known = suffix_format(name)
        kind = f".{known}" if known else os.path.splitext(os.path.basename(name))[1].lower() or "without a suffix"
        kinds.setdefault(kind, []).append(name)
    formats = [kind[1:] for kind in kinds if kind[1:] in FORMATS]
    if len(kinds) == 1 and formats:
        return formats[0]
    summary = ", ".join(f"{len(names)} {kind} ({', '.join(names[:EXAMPLES])}"
                        f"{', ...' if len(names) > EXAMPLES else ''})" for kind, names in kinds.items())
    if len(formats) == len(kinds):
        raise InvalidRequest("--input", f"{input_path} mixes formats: {summary}; give a glob of one, as "
                                        f"'{_within(input_path, '*.' + formats[0])}'")
    raise InvalidRequest("--input", f"the suffixes of the files of {input_path} tell no one format: {summary} "
                                    f"(known: {', '.join(SUFFIXES)}); give --format, or a glob of the files to read")


def _within(input_path: str, name: str) -> str:
    """``name`` within the folder ``input_path`` (a glob's: its part before the first name with a special
    character)."""
    folder = _split_glob(input_path)[0] if is_glob(input_path) else input_path
    return f"{folder.rstrip('/')}/{name}" if folder else name
