"""How the ``refengine`` and ``conformance`` commands report bad input: one line on stderr, exit
status 2, no traceback.

Two kinds of bad input, one form:

- a flag's value that is malformed or out of range (``--threads 0``): the parser refuses it before
  any work, as ``<prog> <cmd>: argument --flag: <what is wrong>, got <value>``; every flag that
  takes a number declares its range with ``int_at_least`` / ``float_above`` (the settings test
  walks every parser and fails on a numeric flag without one);
- a setting, checkpoint, device or prompt that the engine refuses (``report``): its own message, in the
  command's words: the Python API names its fields (``device='cuda'``), the command names its flags
  (``--device cuda``) and the fix a user of the command has (``speak_flags``, one table, FLAGS);
- an unknown flag: the subcommand's help, and the closest flag it has (``OneLineParser.parse_args``).

Anything else is a bug and keeps its traceback.

Importing it loads no torch (the parsers are built, and ``--help`` and usage errors answered, before
torch loads): ``SETUP_ERRORS`` and ``REQUEST_ERRORS`` import the engine's error classes when first used.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import math
import re
import sys
from collections.abc import Callable

from refengine.config import DTYPE_CHOICES, ConfigError

USAGE_EXIT = 2


def __getattr__(name: str):
    """SETUP_ERRORS: errors from building an engine out of the user's settings and checkpoint (a drafter
    that the checkpoint cannot serve and a bad tokenizer file raise plain ValueError; a missing file
    OSError). REQUEST_ERRORS: errors from running the user's prompts."""
    if name not in ("SETUP_ERRORS", "REQUEST_ERRORS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from refengine.core import EngineError
    from refengine.model.loader import CheckpointError

    if name == "SETUP_ERRORS":
        return (ConfigError, CheckpointError, EngineError, ValueError, OSError, NotImplementedError)
    return (ConfigError, EngineError)


# The engine's settings (LLM / EngineConfig fields, as the Python API's messages name them) -> the flag
# that sets each on the command line (refengine generate, bench, report; conformance's --device/--dtype).
FLAGS = {
    "device": "--device",
    "dtype": "--dtype",
    "engine": "--engine",
    "graph_mode": "--graph-mode",
    "num_speculative_tokens": "--num-spec-tokens",
    "drafter": "--drafter",
    "prompt_lookup_min": "--prompt-lookup-min",
    "prompt_lookup_max": "--prompt-lookup-max",
    "enable_prefix_caching": "--enable-prefix-caching",
    "mamba_cache_mode": "--mamba-cache-mode",
    "max_num_seqs": "--max-num-seqs",
    "block_size": "--block-size",
    "seed": "--seed",
    "max_tokens": "--max-tokens",
    "ignore_eos": "--ignore-eos",
    # the request's parameters (SamplingParams fields, vLLM's names)
    "stop_token_ids": "--stop-token-ids",
    "min_tokens": "--min-tokens",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
    "repetition_penalty": "--repetition-penalty",
    "logit_bias": "--logit-bias",
    "allowed_token_ids": "--allowed-token-ids",
    "bad_words": "--bad-words",
    "stop": "--stop",
    "include_stop_str_in_output": "--include-stop-str-in-output",
    "prompt_logprobs": "--prompt-logprobs",
    "logprobs": "--logprobs",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
}
# flags without a value: name=True is the flag itself
SWITCHES = ("enable_prefix_caching", "ignore_eos", "include_stop_str_in_output")
# The Python API's advice -> what a user of the command does instead (matched after the flags are spoken).
FIXES = {
    "(use --num-spec-tokens 0 or --drafter scripted)": (
        "(give the checkpoint a head: `refengine add-mtp-head SRC DST`, then --model DST; or draft without "
        "one: --drafter ngram; or --num-spec-tokens 0)"
    ),
    "(pass token ids)": "(give the prompt as token ids: --prompt-ids)",
}
_VALUE = r"""'[^']*'|"[^"]*"|True|False|-?\d+(?:\.\d+)?"""


def speak_flags(message: str) -> str:
    """``message`` of the engine's Python API in a command's words: ``device='cuda'`` is ``--device cuda``,
    ``enable_prefix_caching=True`` is ``--enable-prefix-caching``, a setting named alone is its flag
    (``graph_mode must be ...``: ``--graph-mode must be ...``), and the API's advice the command's (FIXES)."""
    names = "|".join(sorted(FLAGS, key=len, reverse=True))

    def assignment(m: re.Match) -> str:
        name, value = m.group(1), m.group(2)
        if name in SWITCHES and value in ("True", "False"):
            return FLAGS[name] if value == "True" else f"no {FLAGS[name]}"
        return f"{FLAGS[name]} {value.strip(chr(39) + chr(34))}"

    message = re.sub(rf"(?<![\w.\[-])({names})=({_VALUE})", assignment, message)
    # A setting named alone: those spelt with an underscore anywhere; a one-word name (device, seed) only
    # as the subject of the message, where it cannot be the plain word.
    message = re.sub(rf"(?<![\w.\[-])({'|'.join(n for n in FLAGS if '_' in n)})(?![\w=(-])",
                     lambda m: FLAGS[m.group(1)], message)
    message = re.sub(rf"^({names})(?= must |: )", lambda m: FLAGS[m.group(1)], message)
    # ... or of what the engine says about one request (``request 'x': logprobs must be ...``)
    message = re.sub(rf"^(request '[^']*': )({names})(?= must |: )",
                     lambda m: m.group(1) + FLAGS[m.group(2)], message)
    for api, cli in FIXES.items():
        message = message.replace(api, cli)
    return message


# Warnings about the user's own input, which a command prints as one line (``prog: warning: ...``) instead
# of Python's two (file:line: Category: message, then the source line).
ONE_LINE_WARNINGS = ("UnknownConfigFieldWarning",)


def one_line_warnings(prog: str) -> None:
    """From now on in this process, print ONE_LINE_WARNINGS as ``prog: warning: message`` on stderr
    (compared by name: importing the warning classes would import torch before the parser runs)."""
    import warnings

    shown = warnings.showwarning
    if getattr(shown, "one_line", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if category.__name__ not in ONE_LINE_WARNINGS:
            return shown(message, category, filename, lineno, file, line)
        print(f"{prog}: warning: {' '.join(str(message).split())}", file=file or sys.stderr)

    show.one_line = True
    warnings.showwarning = show


def setting_message(exc: BaseException) -> str:
    """A refused setting (``ConfigError``) in a command's words; any other error as it is (a scenario
    file's fields, for one, are not flags)."""
    return speak_flags(str(exc)) if isinstance(exc, ConfigError) else str(exc)


def report(prog: str, exc: BaseException) -> int:
    """Print ``prog: message`` as one line on stderr (in the command's words: ``speak_flags``) and return
    the usage exit status."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"{prog}: {speak_flags(message)}", file=sys.stderr)
    return USAGE_EXIT


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line, ``<prog>: <message>``, exit status 2.

    argparse's own form (the usage block, then the error) buries the one line that says what is
    wrong; ``--help`` still prints the usage. Subparsers are of the same class. An unknown flag is
    refused by the subcommand it was given to, naming that subcommand's help and its closest flag.
    """

    def error(self, message: str):
        self.exit(USAGE_EXIT, f"{self.prog}: {' '.join(message.split())} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self._chosen(namespace)._refuse(extras)
        return namespace

    def _chosen(self, namespace) -> OneLineParser:
        """The (sub)parser the command line chose: the one whose flags the arguments were checked against."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(namespace, action.dest, None))
                if isinstance(chosen, OneLineParser):
                    return chosen._chosen(namespace)
        return self

    def _refuse(self, extras: list[str]):
        message = f"unrecognized argument{'s' if len(extras) > 1 else ''}: {' '.join(extras)}"
        flag = next((a.split("=", 1)[0] for a in extras if a.startswith("--")), None)
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6) if flag else []
        if close:
            message += f"; did you mean {close[0]}?"
        self.error(message)


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


def finite_number(text: str) -> float:
    """An argparse ``type``: a finite number (its range is the setting's own to refuse, naming the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


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


def docstring_of(module: str) -> str | None:
    """A module's docstring read from its source, without importing it (and what it imports): the help
    of a command whose text is its module's docstring."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return None
    with open(spec.origin, encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read()), clean=False)
