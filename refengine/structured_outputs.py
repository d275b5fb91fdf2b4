"""Structured outputs: a request's output held to a JSON schema, a regular expression, a choice of strings or
an EBNF grammar (vLLM 0.33's ``StructuredOutputsParams``), enforced by xgrammar with the request's tokenizer
(``refengine.grammar``, which the engine loads only for a request that asks).

``StructuredOutputsParams`` is validated where it is built (exactly one constraint); the engine compiles
it when the request is added, and a schema or pattern xgrammar refuses is the request's error. A request
whose grammar completes (its matcher accepted the end token) finishes with ``finish_reason="stop"``. This
module imports neither torch nor xgrammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from refengine.config import ConfigError

KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of ``json`` (a JSON schema, as a dict or its text), ``regex``, ``choice`` (the output is
    one of these strings) or ``grammar`` (EBNF, xgrammar's dialect)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False  # JSON: no whitespace beyond the compact form

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ConfigError(f"structured_outputs takes exactly one of {list(KINDS)}, got {given or 'none'}")
        if self.json is not None:
            if not isinstance(self.json, str | dict):
                raise ConfigError(f"structured_outputs.json must be a JSON schema (dict or str), got "
                                  f"{type(self.json).__name__}")
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            object.__setattr__(self, "json", text)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice):
                raise ConfigError(f"structured_outputs.choice must be a list of non-empty strings, got "
                                  f"{self.choice!r}")
            if not self.choice:
                raise ConfigError("structured_outputs.choice must not be empty")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.disable_any_whitespace, bool):
            raise ConfigError(f"structured_outputs.disable_any_whitespace must be a bool, got "
                              f"{self.disable_any_whitespace!r}")

    @classmethod
    def of(cls, value) -> StructuredOutputsParams | None:
        """None, an instance, or its fields as a dict (scenario files, JSON requests)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"structured_outputs must be StructuredOutputsParams or a dict, got {value!r}")
        unknown = sorted(set(value) - {*KINDS, "disable_any_whitespace"})
        if unknown:
            raise ConfigError(f"structured_outputs: unknown field(s) {unknown}")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on (the per-engine cache's key)."""
        return (self.kind, getattr(self, self.kind), self.disable_any_whitespace)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """The EBNF whose language is exactly ``choices`` (string literals, quotes and backslashes escaped)."""
    def literal(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return "root ::= " + " | ".join(literal(c) for c in choices)
