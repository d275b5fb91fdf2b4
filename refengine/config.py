"""Engine configuration: validated dataclasses; impossible combinations fail at construction."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch


class GraphMode(enum.StrEnum):
    """How the async engine replays steps (see ``refengine.async_engine.graphs``)."""

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @property
    def has_full(self) -> bool:
        return self in (GraphMode.FULL, GraphMode.FULL_AND_PIECEWISE)

    @property
    def has_piecewise(self) -> bool:
        return self in (GraphMode.PIECEWISE, GraphMode.FULL_AND_PIECEWISE)


GRAPH_MODES = tuple(m.value for m in GraphMode)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from the scheduler limits

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(slots=True)
class SpeculativeConfig:
    num_speculative_tokens: int = 0
    drafter: object = "mtp"  # "mtp", "scripted", or a Drafter instance

    def __post_init__(self):
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        from refengine.drafters import DRAFTERS

        if isinstance(self.drafter, str) and self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {tuple(DRAFTERS)} or a Drafter instance, got {self.drafter!r}")

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None
    engine: str = "reference"
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    graph_mode: GraphMode | str = GraphMode.NONE
    recurrent_prefill_chunked: bool = False  # False keeps logits independent of prefill chunk boundaries
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self):
        if self.engine not in ("reference", "async"):
            raise ValueError(f"engine must be 'reference' or 'async', got {self.engine!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be one of {GRAPH_MODES}, got {self.graph_mode!r}")
        self.graph_mode = GraphMode(self.graph_mode)
        if self.engine == "reference" and self.graph_mode is not GraphMode.NONE:
            raise ValueError("graph_mode: the reference engine runs without graphs (graph_mode='none')")
        k = self.speculative.num_speculative_tokens
        if self.scheduler.max_num_batched_tokens < 1 + k:
            raise ValueError(
                f"max_num_batched_tokens ({self.scheduler.max_num_batched_tokens}) must be >= 1 + "
                f"num_speculative_tokens ({1 + k}) so a verify row always fits"
            )
        if self.cache.num_kv_blocks is not None and self.cache.num_kv_blocks < self.blocks_per_request:
            raise ValueError(
                f"num_kv_blocks ({self.cache.num_kv_blocks}) cannot hold one request of max_model_len "
                f"{self.scheduler.max_model_len}: needs {self.blocks_per_request} blocks of {self.cache.block_size}"
            )

    @property
    def num_lookahead_tokens(self) -> int:
        """KV positions reserved past the verify tokens for the drafter's chained steps."""
        return self.speculative.num_speculative_tokens

    @property
    def blocks_per_request(self) -> int:
        """Blocks one request may need at most: max_model_len plus the verify overshoot and lookahead."""
        k = self.speculative.num_speculative_tokens
        return math.ceil((self.scheduler.max_model_len + 2 * k) / self.cache.block_size)

    @property
    def num_kv_blocks(self) -> int:
        if self.cache.num_kv_blocks is not None:
            return self.cache.num_kv_blocks
        per_seq = math.ceil(min(self.scheduler.max_model_len, 512) / self.cache.block_size) + 1
        return max(self.blocks_per_request, self.scheduler.max_num_seqs * per_seq)

    @property
    def num_state_slots(self) -> int:
        return self.scheduler.max_num_seqs * (1 + self.speculative.num_speculative_tokens)
