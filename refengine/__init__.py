"""A readable reference engine and an optimized async engine for hybrid recurrent / attention models with MTP
drafts: Qwen3-Next / Qwen3.5 (Gated DeltaNet) and Nemotron-H (Mamba2)."""

from refengine.config import ConfigError
from refengine.llm import LLM
from refengine.outputs import RequestOutput, RowRecord, StepRecord
from refengine.sampling_params import SamplingParams

__all__ = ["LLM", "ConfigError", "RequestOutput", "RowRecord", "SamplingParams", "StepRecord"]
