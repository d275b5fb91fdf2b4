"""A readable reference engine and an optimized async engine for hybrid recurrent / attention models with MTP
drafts: Qwen3-Next / Qwen3.5 (Gated DeltaNet) and Nemotron-H (Mamba2).

The names below load on first use (``from refengine import LLM`` works as ever): importing the package, or
a torch-free part of it such as ``refengine.config`` or the command lines' parsers, loads no torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refengine.config import ConfigError
    from refengine.llm import LLM
    from refengine.outputs import RequestOutput, RowRecord, StepRecord
    from refengine.sampling_params import SamplingParams

__all__ = ["LLM", "ConfigError", "RequestOutput", "RowRecord", "SamplingParams", "StepRecord"]
_HOMES = {
    "LLM": "refengine.llm",
    "ConfigError": "refengine.config",
    "RequestOutput": "refengine.outputs",
    "RowRecord": "refengine.outputs",
    "StepRecord": "refengine.outputs",
    "SamplingParams": "refengine.sampling_params",
}


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value  # loaded once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
