"""The command line's value types: each converts a flag's text or raises ``argparse.ArgumentTypeError``, whose
message argparse prints as is (``must be a positive integer, got '0'``), and which ``flags_from_env`` reports for
an environment variable."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any


# argparse names a type function in its message when it raises ValueError ("invalid positive_int value"); these
# raise ArgumentTypeError, whose message argparse prints as is, saying what is expected.
def _number(text: str, kind: type, low: float, high: float, expected: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:  # "not <=" also refuses nan
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, 1, float("inf"), "a positive integer")


def non_negative_int(text: str) -> int:
    return _number(text, int, 0, float("inf"), "an integer >= 0")


def non_negative_float(text: str) -> float:
    return _number(text, float, 0, float("inf"), "a number >= 0")


def positive_float(text: str) -> float:
    # from the smallest float above 0 to the largest finite one: refuses 0, inf and nan
    return _number(text, float, math.ulp(0.0), sys.float_info.max, "a finite number > 0")


def replica_count(text: str) -> int | str:
    return text if text == "auto" else positive_int(text)


def port(text: str) -> int:
    return _number(text, int, 0, 65535, "a port number, 0 to 65535")


def word_list(text: str) -> list[str]:
    words = [word.strip() for word in text.split(",")]
    if not all(words):
        raise argparse.ArgumentTypeError(f"must be comma-separated words, e.g. yes,no, got {text!r}")
    return words


def id_list(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"must be comma-separated token ids >= 0, e.g. 9693,2152, got {text!r}")
    return ids
