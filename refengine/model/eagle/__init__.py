"""EAGLE draft heads (EAGLE-1 and EAGLE-3) as vLLM 0.33 serves them: the head's config view, the modules and
the loader for vLLM's tensor names. The drafter that runs them is ``refengine.drafters.eagle``."""

from refengine.model.eagle.config import (
    EAGLE1,
    EAGLE3,
    METHODS,
    EagleHeadConfig,
    EagleHeadError,
    default_aux_layer_ids,
)
from refengine.model.eagle.head import CACHE_PREFIX, Eagle1Head, Eagle3Head, cache_key, head_cache_specs
from refengine.model.eagle.loader import load_eagle_head, read_head_tensors, target_num_layers

__all__ = ["CACHE_PREFIX", "EAGLE1", "EAGLE3", "METHODS", "Eagle1Head", "Eagle3Head", "EagleHeadConfig",
           "EagleHeadError", "cache_key", "default_aux_layer_ids", "head_cache_specs", "load_eagle_head",
           "read_head_tensors", "target_num_layers"]
