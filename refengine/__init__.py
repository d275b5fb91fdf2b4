"""A readable reference engine for hybrid Gated DeltaNet / attention models with MTP drafts."""

from refengine.config import ConfigError
from refengine.llm import LLM
from refengine.outputs import RequestOutput, RowRecord, StepRecord
from refengine.sampling_params import SamplingParams

__all__ = ["LLM", "ConfigError", "RequestOutput", "RowRecord", "SamplingParams", "StepRecord"]
