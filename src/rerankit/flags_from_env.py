"""``rerankit serve``'s flags from the environment: each flag can also be set as ``RERANKIT_<FLAG>`` (the flag's
name in capitals, dashes as underscores: ``--max-batch-items`` is ``$RERANKIT_MAX_BATCH_ITEMS``), as containers and
process managers configure servers (TEI and Infinity read their flags so too). The command line wins over the
environment, the environment over the defaults. A switch (``--no-warmup``) takes 1/true/yes/on or 0/false/no/off.
``--api-key``, which may be given several times, has its own variable (``$RERANKIT_API_KEY``, one key).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

PREFIX = "RERANKIT_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def variable_of(action: argparse.Action) -> str | None:
    """The environment variable of a flag (its first long option), or None for an action that takes none."""
    long = next((option for option in action.option_strings if option.startswith("--")), None)
    if long is None or isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._AppendAction)):
        return None
    return PREFIX + long[2:].upper().replace("-", "_")


def defaults_from_environment(parser: argparse.ArgumentParser,
                              environ: Mapping[str, str] | None = None) -> list[str]:
    """Make each flag of ``parser`` whose variable is set default to its value, converted and checked as the flag
    would be; returns what was wrong with the variables that could not be taken (kept to be raised only when
    the command runs: a stray variable must not break other commands)."""
    environ = os.environ if environ is None else environ
    problems = []
    for action in parser._actions:
        name = variable_of(action)
        text = None if name is None else environ.get(name)
        if text is None:
            continue
        if action.nargs == 0:  # a switch: store_true / store_false
            word = text.strip().lower()
            if word not in _TRUE + _FALSE:
                problems.append(f"${name}={text!r}: give one of {', '.join(_TRUE + _FALSE)}")
            elif word in _TRUE:
                action.default = action.const
            continue
        try:
            value = action.type(text) if callable(action.type) else text
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            problems.append(f"${name}={text!r}: {exc}")
            continue
        if action.choices is not None and value not in action.choices:
            problems.append(f"${name}={text!r}: choose from {', '.join(map(str, action.choices))}")
            continue
        action.default = value
    return problems
