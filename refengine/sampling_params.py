"""Per-request generation parameters, with vLLM's spellings and meanings.

``temperature=0`` (the default) is greedy decoding; ``temperature > 0`` samples after ``min_p``,
``top_k`` and ``top_p`` (``refengine.sampling``, vLLM's order), its random numbers a function of
``seed`` and the position only (a request without a seed gets one at admission, reported in its
output). The logits processors
(``allowed_token_ids``, ``bad_words``, ``logit_bias``, ``min_tokens``, the three penalties), stop
strings and ``logprobs`` have vLLM's spellings and meanings; ``refengine.logits_process`` applies them
in vLLM 0.33's order, and decoding is the argmax of the processed logits. What needs the model
(ids inside the vocabulary, ``bad_words`` and ``stop`` needing a tokenizer) is checked by the engine.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from refengine.config import ConfigError, check_bool, check_int
from refengine.structured_outputs import StructuredOutputsParams

SAMPLING_EPS = 1e-5  # a temperature below this is greedy decoding (vLLM's _SAMPLING_EPS)


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 32
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] | None = ()  # None: no stop ids (vLLM's default)
    temperature: float = 0.0  # >= 0; 0: greedy (top_k, top_p, min_p and seed then change nothing)
    top_p: float = 1.0  # (0, 1]: sample from the likeliest ids whose mass reaches it
    top_k: int = 0  # 0 or -1: no top-k; else >= 1
    min_p: float = 0.0  # [0, 1]: ids below min_p * the top probability are dropped
    seed: int | None = None  # [0, 2**63); None: drawn at admission and reported (RequestOutput.seed)
    min_tokens: int = 0  # no stop (EOS, stop ids, stop strings) before this many output tokens
    presence_penalty: float = 0.0  # [-2, 2], subtracted once from every id in the output
    frequency_penalty: float = 0.0  # [-2, 2], subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # > 0: ids in the prompt or output have positive logits divided by it,
    #                                  negative ones multiplied
    logit_bias: dict[int, float] | None = None  # token id -> bias added (clamped to [-100, 100], as vLLM)
    allowed_token_ids: tuple[int, ...] | None = None  # only these ids may be chosen
    bad_words: tuple[str, ...] | None = None  # words never completed (encoded as vLLM encodes them)
    stop: tuple[str, ...] | None = None  # stop strings, found in the output text
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-n raw logprobs per output token (the chosen token always included)
    prompt_logprobs: int | None = None  # top-n raw logprobs per prompt token (the prompt token included)
    # the output held to a JSON schema, regex, choice or grammar (``refengine.structured_outputs``; a dict
    # of its fields is taken too)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        object.__setattr__(self, "max_tokens", check_int("max_tokens", self.max_tokens, 1))
        check_bool("ignore_eos", self.ignore_eos)
        object.__setattr__(self, "stop_token_ids", _stop_ids(self.stop_token_ids))
        _sampling(self)
        check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ConfigError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)
        rep = _number("repetition_penalty", self.repetition_penalty)
        if not math.isfinite(rep) or rep <= 0.0:
            raise ConfigError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        object.__setattr__(self, "repetition_penalty", rep)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            ids = _stop_ids(self.allowed_token_ids, "allowed_token_ids")
            if not ids:
                raise ConfigError("allowed_token_ids must not be empty (None allows every id)")
            object.__setattr__(self, "allowed_token_ids", ids)
        object.__setattr__(self, "bad_words", _strings("bad_words", self.bad_words))
        object.__setattr__(self, "stop", _strings("stop", self.stop))
        check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        check_int("logprobs", self.logprobs, 0, optional=True)
        check_int("prompt_logprobs", self.prompt_logprobs, 0, optional=True)
        object.__setattr__(self, "structured_outputs", StructuredOutputsParams.of(self.structured_outputs))

    @property
    def samples(self) -> bool:
        """Whether tokens are drawn (else the argmax of the processed logits is taken)."""
        return self.temperature > 0.0

    @property
    def has_processors(self) -> bool:
        """Whether any logits processor changes this request's logits (else they are left as they are)."""
        return bool(self.allowed_token_ids or self.bad_words or self.logit_bias or self.min_tokens
                    or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _sampling(params: SamplingParams) -> None:
    """Check and normalise the sampling fields (vLLM's ranges); ConfigError names the field."""
    temperature = _number("temperature", params.temperature)
    if not math.isfinite(temperature) or temperature < 0.0:
        raise ConfigError(f"temperature must be a finite number >= 0, got {params.temperature!r}")
    top_p = _number("top_p", params.top_p)
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p must be in (0, 1], got {params.top_p!r}")
    check_int("top_k", params.top_k, -1)
    min_p = _number("min_p", params.min_p)
    if not 0.0 <= min_p <= 1.0:
        raise ConfigError(f"min_p must be in [0, 1], got {params.min_p!r}")
    seed = check_int("seed", params.seed, 0, optional=True)
    if seed is not None and seed >= 1 << 63:
        raise ConfigError(f"seed must be < 2**63, got {params.seed!r}")
    if temperature < SAMPLING_EPS:
        temperature = 0.0  # vLLM's rule: greedy below this
    for name, value in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p),
                        ("top_k", int(params.top_k)), ("seed", seed)):
        object.__setattr__(params, name, value)


def _stop_ids(value, name: str = "stop_token_ids") -> tuple[int, ...]:
    """None or a sequence of non-negative ints -> a tuple (the vocabulary bound is checked by the engine)."""
    if value is None:
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | set | frozenset):
        raise ConfigError(f"{name} must be a sequence of token ids or None, got {value!r}")
    ids = []
    for pos, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ConfigError(
                f"{name} must hold non-negative int ids, got {value!r} ({t!r} at index {pos})"
            )
        ids.append(int(t))
    return tuple(ids)


def _logit_bias(value) -> dict[int, float] | None:
    """{token id: bias}, each bias clamped to [-100, 100] as vLLM clamps it; None or {} for none."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"logit_bias must be a dict of token id -> bias, got {value!r}")
    out = {}
    for t, b in value.items():
        if isinstance(t, str) and t.strip().lstrip("-").isdigit():
            t = int(t)  # vLLM accepts the ids as strings (JSON keys)
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ConfigError(f"logit_bias keys must be non-negative int ids, got {t!r}")
        bias = _number(f"logit_bias[{t}]", b)
        if not math.isfinite(bias):
            raise ConfigError(f"logit_bias[{t}] must be finite, got {b!r}")
        out[int(t)] = min(100.0, max(-100.0, bias))
    return out or None


def _strings(name: str, value) -> tuple[str, ...] | None:
    """None, a string, or a sequence of non-empty strings -> a tuple (None when empty)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Sequence):
        raise ConfigError(f"{name} must be a string or a list of strings, got {value!r}")
    for pos, v in enumerate(value):
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{name} must hold non-empty strings, got {v!r} at index {pos}")
    return tuple(value) or None
