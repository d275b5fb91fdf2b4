"""Per-request generation parameters (greedy only: the suite compares argmax decisions).

vLLM's sampling fields are accepted where they mean greedy decoding (``temperature=0.0``,
``top_p=1.0``, ``top_k`` 0 or -1) and refused by name otherwise.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from refengine.config import ConfigError, check_bool, check_int


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 32
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] | None = ()  # None: no stop ids (vLLM's default)
    temperature: float = 0.0  # greedy only
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k

    def __post_init__(self):
        object.__setattr__(self, "max_tokens", check_int("max_tokens", self.max_tokens, 1))
        check_bool("ignore_eos", self.ignore_eos)
        object.__setattr__(self, "stop_token_ids", _stop_ids(self.stop_token_ids))
        greedy = "this engine decodes greedily only"
        if _number("temperature", self.temperature) != 0.0:
            raise ConfigError(f"temperature must be 0.0 ({greedy}), got {self.temperature!r}")
        if _number("top_p", self.top_p) != 1.0:
            raise ConfigError(f"top_p must be 1.0 ({greedy}), got {self.top_p!r}")
        object.__setattr__(self, "temperature", 0.0)
        object.__setattr__(self, "top_p", 1.0)
        check_int("top_k", self.top_k, -1)
        if self.top_k not in (0, -1):
            raise ConfigError(f"top_k must be 0 or -1 ({greedy}), got {self.top_k!r}")


def _stop_ids(value) -> tuple[int, ...]:
    """None or a sequence of non-negative ints -> a tuple (the vocabulary bound is checked by the engine)."""
    if value is None:
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | set | frozenset):
        raise ConfigError(f"stop_token_ids must be a sequence of token ids or None, got {value!r}")
    ids = []
    for pos, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ConfigError(
                f"stop_token_ids must hold non-negative int ids, got {value!r} ({t!r} at index {pos})"
            )
        ids.append(int(t))
    return tuple(ids)
