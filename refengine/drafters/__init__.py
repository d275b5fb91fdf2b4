"""Drafters: one module per method, registered by name.

``make_drafter`` turns the speculative configuration into a ``Drafter`` (or None without
speculation). To add a method, write its module with a class following
``refengine.drafters.base.Drafter`` and register its constructor here.
"""

from __future__ import annotations

from refengine.drafters.base import (
    DeviceDraftContext,
    Drafter,
    DrafterInputError,
    DraftInputs,
    HostDraftContext,
    Proposal,
    drafter_cache_specs,
)
from refengine.drafters.draft_model import DraftModelDrafter
from refengine.drafters.eagle import EagleDrafter
from refengine.drafters.mtp import MTPDrafter
from refengine.drafters.ngram import NgramDrafter
from refengine.drafters.scripted import PATTERNS, ScriptedDrafter

# name -> constructor taking (SpeculativeConfig, vocab_size, max_model_len)
DRAFTERS = {
    "mtp": lambda spec, vocab, max_len: MTPDrafter(spec.num_speculative_tokens),
    "scripted": lambda spec, vocab, max_len: ScriptedDrafter(spec.num_speculative_tokens, vocab),
    "ngram": lambda spec, vocab, max_len: NgramDrafter(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                                       spec.prompt_lookup_max, max_len),
    "eagle": lambda spec, vocab, max_len: EagleDrafter("eagle", spec.num_speculative_tokens,
                                                       spec.draft_model),
    "eagle3": lambda spec, vocab, max_len: EagleDrafter("eagle3", spec.num_speculative_tokens,
                                                        spec.draft_model),
    "draft_model": lambda spec, vocab, max_len: DraftModelDrafter(spec.num_speculative_tokens,
                                                                  spec.draft_model, vocab),
}


def make_drafter(spec, vocab_size: int, max_model_len: int) -> Drafter | None:
    """The configured drafter: a registered name or an instance; None when speculation is off."""
    if not spec.enabled:
        return None
    if isinstance(spec.drafter, str):
        if spec.drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {spec.drafter!r}; registered: {', '.join(DRAFTERS)}")
        return DRAFTERS[spec.drafter](spec, vocab_size, max_model_len)
    drafter = spec.drafter
    if getattr(drafter, "num_speculative_tokens", None) != spec.num_speculative_tokens:
        raise ValueError(
            f"drafter {getattr(drafter, 'method', drafter)!r} proposes "
            f"{getattr(drafter, 'num_speculative_tokens', '?')} tokens but num_speculative_tokens is "
            f"{spec.num_speculative_tokens}"
        )
    return drafter


__all__ = ["DRAFTERS", "PATTERNS", "DeviceDraftContext", "DraftInputs", "DraftModelDrafter", "Drafter",
           "DrafterInputError", "EagleDrafter",
           "HostDraftContext", "MTPDrafter", "NgramDrafter", "Proposal", "ScriptedDrafter",
           "drafter_cache_specs", "make_drafter"]
