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
from dataclasses import dataclass

PREFIX = "RERANKIT_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvironmentProblem:
    """The default of a flag whose variable holds a value the flag refuses: raised only if the command line does
    not give the flag (the command line wins), never converted by argparse (it is not a string)."""

    message: str


class FromEnvironment(str):
    """A text flag's value taken from its variable (argparse keeps the default's object), so that a command can
    tell it from one given on the command line."""


def variable_of(action: argparse.Action) -> str | None:
    """The environment variable of a flag (its first long option), or None for an action that takes none."""
    long = next((option for option in action.option_strings if option.startswith("--")), None)
    if long is None or isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._AppendAction)):
        return None
    return PREFIX + long[2:].upper().replace("-", "_")


def defaults_from_environment(parser: argparse.ArgumentParser,
                              environ: Mapping[str, str] | None = None) -> None:
    """Make each flag of ``parser`` whose variable is set default to its value, converted and checked as the flag
    would be. A variable that cannot be taken makes its flag's default an ``EnvironmentProblem``, raised when the
    command runs only if the command line did not give the flag (``environment_problem``): a stray variable must
    not break other commands, nor a flag given on the command line."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        name = variable_of(action)
        text = None if name is None else environ.get(name)
        if text is None:
            continue
        problem = None
        if action.nargs == 0:  # a switch: store_true / store_false
            word = text.strip().lower()
            if word not in _TRUE + _FALSE:
                problem = f"${name}={text!r}: give one of {', '.join(_TRUE + _FALSE)}"
            elif word in _TRUE:
                action.default = action.const
        else:
            try:
                value = action.type(text) if callable(action.type) else FromEnvironment(text)
            except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
                problem = f"${name}={text!r}: {exc}"
            else:
                if action.choices is not None and value not in action.choices:
                    problem = f"${name}={text!r}: choose from {', '.join(map(str, action.choices))}"
                else:
                    action.default = value
        if problem is not None:
            if text.startswith("tcp://"):  # Kubernetes' service links: a Service named rerankit sets RERANKIT_PORT
                problem += (" (Kubernetes sets it for a Service of that name: give the flag on the command line, "
                            "or set enableServiceLinks: false)")
            action.default = EnvironmentProblem(problem)


def environment_problem(args: argparse.Namespace) -> str | None:
    """The first problem of a variable whose flag the command line did not give (it would have replaced it)."""
    return next((value.message for value in vars(args).values() if isinstance(value, EnvironmentProblem)), None)
