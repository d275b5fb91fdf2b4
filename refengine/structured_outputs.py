"""Structured outputs: a request's output held to a JSON schema, a regular expression, a choice of strings or
an EBNF grammar (vLLM 0.33's ``StructuredOutputsParams``), enforced by xgrammar with the request's tokenizer.

``StructuredOutputsParams`` is validated where it is built (exactly one constraint). The engine compiles
it once per engine (``GrammarCompiler``, a cache per engine: two engines never share one) when the request
is added; a schema or pattern xgrammar refuses is the request's error. Each running request holds one
``GrammarState``, a matcher advanced with each committed output token (``refengine.postprocess``) and only
those. Before a step verifies a row, ``window_bitmask`` gives the allowed ids of each of its positions:
position j is the grammar's after the drafts before it, accepted tentatively and rolled back afterwards;
a draft the grammar refuses ends the window (positions after it keep everything allowed: the verifier
can keep none of them, since the refused draft is masked at its own position). ``apply_bitmask`` masks
logits with such rows; both engines call it, the async engine inside its step program on a bitmask the host
built for the step in flight. A request whose grammar completes (its matcher accepted the end token)
finishes with ``finish_reason="stop"``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

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


class GrammarCompiler:
    """xgrammar's compiler over one engine's tokenizer, with that engine's cache of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        import xgrammar

        self.xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: dict[tuple, object] = {}

    def compile(self, p: StructuredOutputsParams):
        """The compiled grammar of ``p``; ValueError names the field xgrammar refused and why."""
        got = self._compiled.get(p.key)
        if got is not None:
            return got
        c = self.compiler
        try:
            if p.json is not None:
                got = c.compile_json_schema(p.json, any_whitespace=not p.disable_any_whitespace)
            elif p.regex is not None:
                got = c.compile_regex(p.regex)
            elif p.choice is not None:
                got = c.compile_grammar(choice_grammar(p.choice))
            else:
                got = c.compile_grammar(p.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            lines = str(exc).strip().splitlines()
            # xgrammar's messages start "[time] source.cc:line: "; the reason is what follows
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[-1]) if lines else type(exc).__name__
            raise ValueError(f"structured_outputs.{p.kind}: xgrammar cannot compile it: {reason}") from None
        self._compiled[p.key] = got
        return got

    def state(self, compiled, tokens=()) -> GrammarState:
        """A fresh matcher for ``compiled`` advanced by ``tokens`` (a resumed request's committed outputs)."""
        g = GrammarState(self.xgr.GrammarMatcher(compiled), self.vocab_size)
        for t in tokens:
            if not g.accept(t):
                raise RuntimeError(f"committed token {t} breaks the grammar it was decoded under")
        return g


class GrammarState:
    """One request's matcher (advanced by its committed outputs only)."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.width = (vocab_size + 31) // 32  # int32 words of one bitmask row

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance by one committed token; False (and unchanged) when the grammar refuses it."""
        if self.terminated or not 0 <= token < self.vocab_size:
            return False
        return self.matcher.accept_token(token)

    def window_bitmask(self, drafts: list[int]) -> torch.Tensor:
        """[1 + len(drafts), W] int32: row j the ids allowed after the drafts before it (every bit set past a
        draft the grammar refuses, or once it is complete). The matcher is left as it was."""
        out = torch.full((1 + len(drafts), self.width), -1, dtype=torch.int32)
        advanced = 0
        for j in range(len(drafts) + 1):
            if self.terminated:
                break
            self.matcher.fill_next_token_bitmask(out, j)
            if j == len(drafts) or not self.accept(drafts[j]):
                break
            advanced += 1
        if advanced:
            self.matcher.rollback(advanced)
        return out


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [M, V] with every id whose bit is clear in ``bitmask`` [M, W] int32 set to -inf."""
    ids = torch.arange(logits.shape[-1], device=logits.device)
    allowed = (bitmask[:, ids // 32] >> (ids % 32)) & 1  # [M, V]
    return torch.where(allowed.bool(), logits, torch.full_like(logits, float("-inf")))
