"""A mutant: one seed bug re-created in the async engine (``conformance.mutants`` lists them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    id: str
    origin: str  # the seed pull request, or "own" for the other contracts of refengine/README.md
    contract: str  # the contract of refengine/README.md it breaks
    description: str
    patch: Callable  # patch(engine) -> None, applied to a refengine.async_engine.AsyncEngine instance
    graph_mode: str = "full_and_piecewise"
    scenarios: tuple[str, ...] = ()  # scenario ids tried first (the rest of the tier follows)
    # Its scenarios need a tokenizer (stop strings, bad words) and are tuned to the embedded default model:
    # it runs there unless the model given has a tokenizer.
    tokenizer: bool = False
