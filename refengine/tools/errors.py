"""How the ``refengine`` and ``conformance`` commands report bad input: one line on stderr, exit
status 2, no traceback.

Two kinds of bad input, one form:

- a flag's value that is malformed or out of range (``--threads 0``): the parser refuses it before
  any work, as ``<prog> <cmd>: argument --flag: <what is wrong>, got <value>``; every flag that
  takes a number declares its range with ``int_at_least`` / ``float_above`` (the settings test
  walks every parser and fails on a numeric flag without one);
- a setting, checkpoint, device or prompt that the engine refuses (``report``): its own message.

Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from refengine.config import DTYPE_CHOICES, ConfigError
from refengine.core import EngineError
from refengine.model.loader import CheckpointError

USAGE_EXIT = 2
# Errors from building an engine out of the user's settings and checkpoint (a drafter that the
# checkpoint cannot serve and a bad tokenizer file raise plain ValueError; a missing file OSError).
SETUP_ERRORS = (ConfigError, CheckpointError, EngineError, ValueError, OSError, NotImplementedError)
# Errors from running the user's prompts.
REQUEST_ERRORS = (ConfigError, EngineError)


def report(prog: str, exc: BaseException) -> int:
    """Print ``prog: message`` as one line on stderr and return the usage exit status."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"{prog}: {message}", file=sys.stderr)
    return USAGE_EXIT


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line, ``<prog>: <message>``, exit status 2.

    argparse's own form (the usage block, then the error) buries the one line that says what is
    wrong; ``--help`` still prints the usage. Subparsers are of the same class.
    """

    def error(self, message: str):
        self.exit(USAGE_EXIT, f"{self.prog}: {' '.join(message.split())} (see {self.prog} --help)\n")


def add_dtype_flag(
    parser: argparse.ArgumentParser,
    what: str = "the engines",
    default: str | None = "float32",
    default_text: str = "float32",
) -> None:
    """``--dtype float32|bfloat16|float16|auto`` (auto: the checkpoint's own dtype)."""
    parser.add_argument(
        "--dtype",
        default=default,
        choices=DTYPE_CHOICES,
        help=f"dtype {what} run in (default {default_text}; auto: the checkpoint's own dtype, from "
        "its config.json or its first floating-point tensor)",
    )


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum``; anything else names the value it got."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.minimum = minimum  # read by the settings test: this flag has a declared range
    return parse


def float_above(minimum: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number > ``minimum``; anything else names the value it got."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number > {minimum:g}, got {text!r}") from None
        if not value > minimum or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number > {minimum:g}, got {text}")
        return value

    parse.minimum = minimum
    return parse
