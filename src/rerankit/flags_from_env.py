"""``rerankit serve``'s flags from the environment: each flag can also be set as ``RERANKIT_<FLAG>`` (the flag's
name in capitals, dashes as underscores: ``--max-batch-items`` is ``$RERANKIT_MAX_BATCH_ITEMS``), as containers and
process managers configure servers (TEI and Infinity read their flags so too). The command line wins over the
environment, the environment over the defaults. A switch (``--no-warmup``) takes 1/true/yes/on or 0/false/no/off.
``--api-key``, which may be given several times, has its own variable (``$RERANKIT_API_KEY``, one key).
An error naming a flag the environment set names its variable instead (``named_as_set``).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rerankit.errors import RerankitError

PREFIX = "RERANKIT_"
SET_BY_ENVIRONMENT = "_set_by_environment"  # the Namespace attribute of the variables that set flags, by dest
_FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*(?![\w-])")  # a long flag named in a message
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class FromVariable:
    """A flag's default taken from its variable ``name``: the ``value`` the flag makes of it, or the ``problem`` it
    refuses it with. Not a string, so argparse keeps it as is; ``from_environment`` unwraps it, telling the flags
    that the environment set from those the command line gave."""

    name: str
    value: Any = None
    problem: str | None = None


def variable_of(action: argparse.Action) -> str | None:
    """The environment variable of a flag (its first long option), or None for an action that takes none."""
    long = next((option for option in action.option_strings if option.startswith("--")), None)
    if long is None or isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._AppendAction)):
        return None
    return PREFIX + long[2:].upper().replace("-", "_")


def defaults_from_environment(parser: argparse.ArgumentParser,
                              environ: Mapping[str, str] | None = None) -> None:
    """Make each flag of ``parser`` whose variable is set default to a ``FromVariable`` of its value, converted and
    checked as the flag would be. A variable that cannot be taken is reported by ``from_environment`` only if the
    command line did not give the flag: a stray variable must not break other commands, nor a flag given on the
    command line."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        name = variable_of(action)
        text = None if name is None else environ.get(name)
        if name is None or text is None:
            continue
        value, problem = action.default, None
        if action.nargs == 0:  # a switch: store_true / store_false
            word = text.strip().lower()
            if word not in _TRUE + _FALSE:
                problem = f"${name}={text!r}: give one of {', '.join(_TRUE + _FALSE)}"
            elif word in _TRUE:
                value = action.const
        else:
            try:
                value = action.type(text) if callable(action.type) else text
            except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
                problem = f"${name}={text!r}: {exc}"
            else:
                if action.choices is not None and value not in action.choices:
                    problem = f"${name}={text!r}: choose from {', '.join(map(str, action.choices))}"
        if problem is not None and text.startswith("tcp://"):  # Kubernetes' service links: a Service named rerankit
            problem += (" (Kubernetes sets it for a Service of that name: give the flag on the command line, "
                        "or set enableServiceLinks: false)")
        action.default = FromVariable(name, value, problem)


def from_environment(args: argparse.Namespace) -> dict[str, str]:
    """The variables of the flags that the environment set (the command line did not give them), by ``dest``; in
    ``args``, their values replace the ``FromVariable``. ``RerankitError`` for the first that the flag refuses."""
    taken = {dest: value for dest, value in vars(args).items() if isinstance(value, FromVariable)}
    problem = next((value.problem for value in taken.values() if value.problem is not None), None)
    if problem is not None:
        raise RerankitError(problem)
    for dest, value in taken.items():
        setattr(args, dest, value.value)
    return {dest: value.name for dest, value in taken.items()}


# serve's flags that place and size a local engine: set in the environment, they are ignored for a server URL
ENGINE_PLACEMENT = ("device", "dtype", "prefix_cache_mib", "data_parallel_size", "replica_timeout", "startup_timeout")


def settle_serve_environment(args: argparse.Namespace, is_url: Callable[[Any], bool]) -> dict[str, str]:
    """``from_environment`` for ``rerankit serve``, then what the environment set and does not apply is dropped:
    a template of one kind where the command line gave the other kind (the command line wins); the engine's
    placement and size (``ENGINE_PLACEMENT``) for a server URL as the model (``is_url``; an image may set them for
    every server it starts); the replicas' timeouts without replicas. Such a variable is ignored whatever its value.
    Returns the variables of the flags the environment set."""
    def given(dest: str) -> Any:  # the value, whether the command line or the environment gave it
        value = getattr(args, dest)
        return value.value if isinstance(value, FromVariable) else value

    ignored = ENGINE_PLACEMENT if is_url(given("model")) else ()
    if given("data_parallel_size") in (None, 1):
        ignored = (*ignored, "replica_timeout", "startup_timeout")
    for name in ignored:  # dropped before from_environment: a value the flag would refuse does not matter either
        if isinstance(getattr(args, name), FromVariable):
            setattr(args, name, None)
    variables = from_environment(args)
    if "template_file" in variables and args.template is not None and "template" not in variables:
        args.template_file = None
        del variables["template_file"]
    if "template" in variables and args.template_file is not None and "template_file" not in variables:
        args.template = None
        del variables["template"]
    setattr(args, SET_BY_ENVIRONMENT, variables)  # for named_as_set: an error then names them as the user set them
    return variables


def named_as_set(message: str, args: argparse.Namespace) -> str:
    """``message`` with each flag it names that the environment set (``--ssl-keyfile``) named as its variable
    (``$RERANKIT_SSL_KEYFILE``): what the user set. Checks that know only the values (``serve``'s) name flags."""
    variables = getattr(args, SET_BY_ENVIRONMENT, None) or {}
    flags = {"--" + name[len(PREFIX):].lower().replace("_", "-"): name for name in variables.values()}
    return _FLAG.sub(lambda flag: f"${flags[flag.group()]}" if flag.group() in flags else flag.group(), message)
