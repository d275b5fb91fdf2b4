"""The grammar runtime of structured outputs (``refengine.structured_outputs`` says what a request asks):
xgrammar's compiler per engine, one matcher per request, each verify window's bitmask, and the masking.

``GrammarCompiler`` compiles a request's ``StructuredOutputsParams`` once per engine (a cache per engine:
two engines never share one); a schema or pattern xgrammar refuses is a ValueError naming the field.
``GrammarState`` is one request's matcher, advanced with each committed output token (in
``refengine.postprocess``) and only those. ``window_bitmask`` gives the allowed ids of each position of
a verify window: position j is the grammar's after the drafts before it, accepted tentatively and rolled
back afterwards; a draft the grammar refuses ends the window (positions after it keep everything allowed:
the verifier keeps none of them, the refused draft being masked at its own position). ``apply_bitmask``
masks logits with such rows; both engines call it, the async engine inside its step program on the
bitmask the host built for the step.
"""

from __future__ import annotations

import re

import torch

from refengine.structured_outputs import StructuredOutputsParams, choice_grammar


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
