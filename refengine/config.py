"""Engine configuration: validated dataclasses; impossible combinations fail at construction.

Importing it imports no torch (the command lines build their parsers from its names before torch loads):
``check_device``, ``torch_dtype`` and ``DTYPES`` load it when used."""

from __future__ import annotations

import enum
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class ConfigError(ValueError):
    """A setting of the wrong type or out of range; the message names the field and the value."""


def check_int(name: str, value, minimum: int, *, optional: bool = False) -> int | None:
    """``value`` as an int >= ``minimum`` (None allowed when ``optional``); bools and floats refused."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an int{' or None' if optional else ''}, "
                          f"got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_device(name: str, value) -> str:
    """A device this machine has: 'cpu', or 'cuda'/'cuda:N' with CUDA available and N < the device count."""
    import torch

    if not isinstance(value, str | torch.device):
        raise ConfigError(f"{name} must be a device string such as 'cpu' or 'cuda:0', got {value!r}")
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"{name} must be 'cpu', 'cuda' or 'cuda:N', got {value!r}") from None
    if dev.type == "cpu":
        return str(dev)
    if dev.type != "cuda":
        raise ConfigError(f"{name} must be 'cpu', 'cuda' or 'cuda:N', got {value!r}")
    if not torch.cuda.is_available():
        raise ConfigError(f"{name}={value!r} but CUDA is not available on this machine (use device='cpu')")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ConfigError(
            f"{name}={value!r} but this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
        )
    return str(dev)


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
# What "async" means wherever a command picks the graph mode for it (refengine generate and bench,
# conformance's engine "async"): every step's program captured for uniform decode steps, the token
# axis padded.
DEFAULT_ASYNC_GRAPH_MODE = GraphMode.FULL_AND_PIECEWISE.value
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the keys of DTYPES (name -> torch.dtype)
DTYPE_CHOICES = (
    *DTYPE_NAMES,
    "auto",
)  # what LLM(dtype=...) and the commands' --dtype take; auto: the checkpoint's
# The registered drafters' names (refengine.drafters.DRAFTERS' keys, which a test holds equal).
DRAFTER_NAMES = ("mtp", "scripted", "ngram", "eagle", "eagle3", "draft_model")
DRAFT_MODEL_DRAFTERS = ("eagle", "eagle3", "draft_model")  # they read a checkpoint of their own (draft_model)
ENGINES = ("reference", "async")


def graph_mode(value) -> GraphMode:
    """A GraphMode from its name in any case (vLLM spells them "FULL_AND_PIECEWISE")."""
    if isinstance(value, GraphMode):
        return value
    if isinstance(value, str) and value.lower() in GRAPH_MODES:
        return GraphMode(value.lower())
    raise ConfigError(f"graph_mode must be one of {GRAPH_MODES} (any case), got {value!r}")


def check_dtype(name: str, value) -> str:
    if value == "auto":
        raise ConfigError(f"{name}='auto' (the checkpoint's dtype) is resolved by LLM from the checkpoint; "
                          f"an EngineConfig needs one of {DTYPE_NAMES}")
    if not isinstance(value, str) or value not in DTYPE_NAMES:
        raise ConfigError(f"{name} must be one of {DTYPE_NAMES}, got {value!r}")
    return value


def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _torch_dtypes()[name]


def __getattr__(name: str):
    """``DTYPES`` (dtype name -> torch.dtype) is made when used: importing this module loads no torch."""
    if name == "DTYPES":
        return _torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


MAMBA_CACHE_MODES = ("none", "align", "all")


@dataclass(slots=True)
class CacheConfig:
    """``enable_prefix_caching`` shares full KV blocks by the hash of their token prefix and checkpoints
    the recurrent state at block boundaries; ``mamba_cache_mode`` says which boundaries (vLLM's
    spelling): ``"align"`` (the default when caching is on) at the scheduling boundaries clipped to the
    block grid, ``"all"`` at every full block; ``"none"`` only without caching.
    ``num_state_checkpoints``: recurrent state slots kept for checkpoints (None: one per KV block)."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from the scheduler limits
    enable_prefix_caching: bool = False
    mamba_cache_mode: str | None = None  # None: "align" with caching, "none" without
    num_state_checkpoints: int | None = None

    def __post_init__(self):
        self.block_size = check_int("block_size", self.block_size, 1)
        self.num_kv_blocks = check_int("num_kv_blocks", self.num_kv_blocks, 1, optional=True)
        self.enable_prefix_caching = check_bool("enable_prefix_caching", self.enable_prefix_caching)
        mode = self.mamba_cache_mode
        if mode is not None and (not isinstance(mode, str) or mode not in MAMBA_CACHE_MODES):
            raise ConfigError(f"mamba_cache_mode must be one of {MAMBA_CACHE_MODES} or None, got {mode!r}")
        if mode is None:
            mode = "align" if self.enable_prefix_caching else "none"
        if self.enable_prefix_caching and mode == "none":
            raise ConfigError(
                "mamba_cache_mode='none' cannot serve enable_prefix_caching=True on a hybrid model: "
                "a hit needs the recurrent state at its boundary (use 'align' or 'all')"
            )
        if not self.enable_prefix_caching and mode != "none":
            raise ConfigError(f"mamba_cache_mode={mode!r} needs enable_prefix_caching=True")
        self.mamba_cache_mode = mode
        self.num_state_checkpoints = check_int("num_state_checkpoints", self.num_state_checkpoints, 1,
                                               optional=True)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024

    def __post_init__(self):
        self.max_num_seqs = check_int("max_num_seqs", self.max_num_seqs, 1)
        self.max_num_batched_tokens = check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        self.max_model_len = check_int("max_model_len", self.max_model_len, 2)


# vLLM's ``speculative_config`` keys this engine reads, and the methods it names that run here.
VLLM_SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min",
                         "prompt_lookup_max")
VLLM_METHODS = ("mtp", "ngram", "eagle", "eagle3", "draft_model")


def speculative_from_vllm(config: dict) -> dict:
    """vLLM's ``speculative_config`` dict -> ``SpeculativeConfig`` keyword arguments: ``method`` ->
    ``drafter``, ``model`` -> ``draft_model``, ``num_speculative_tokens`` and the n-gram lengths as they are.
    A key this engine does not read, or a method it does not run, raises ConfigError naming it."""
    if not isinstance(config, dict):
        raise ConfigError(f"speculative_config must be a dict, got {type(config).__name__} {config!r}")
    unknown = sorted(str(key) for key in config if key not in VLLM_SPECULATIVE_KEYS)
    if unknown:
        raise ConfigError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; this engine "
                          f"reads {', '.join(VLLM_SPECULATIVE_KEYS)}")
    if "method" not in config:
        raise ConfigError(f"speculative_config needs a 'method', one of {VLLM_METHODS}")
    method = config["method"]
    if method not in VLLM_METHODS:
        raise ConfigError(f"speculative_config: method must be one of {VLLM_METHODS}, got {method!r}")
    if "num_speculative_tokens" not in config:
        raise ConfigError("speculative_config needs 'num_speculative_tokens'")
    out = {"drafter": method, "num_speculative_tokens": config["num_speculative_tokens"]}
    if "model" in config:
        out["draft_model"] = config["model"]
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if key in config:
            out[key] = config[key]
    return out


@dataclass(slots=True)
class SpeculativeConfig:
    num_speculative_tokens: int = 0
    drafter: object = "mtp"  # "mtp", "scripted", "ngram", or a Drafter instance
    # drafter="ngram": the n-gram lengths prompt lookup tries (vLLM's names and defaults: both 5 when
    # neither is given, the given one when only one is)
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # drafter="eagle" | "eagle3" | "draft_model": the drafter's checkpoint directory (vLLM's ``model``)
    draft_model: str | None = None

    def __post_init__(self):
        self.num_speculative_tokens = check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        d = self.drafter
        is_instance = not isinstance(d, str) and all(
            callable(getattr(d, m, None)) for m in ("check_model", "host_proposer", "device_proposer"))
        if not is_instance and d not in DRAFTER_NAMES:
            raise ConfigError(f"drafter must be one of {DRAFTER_NAMES} or a Drafter instance, got {d!r}")
        if self.draft_model is not None and not isinstance(self.draft_model, str | os.PathLike):
            raise ConfigError(f"draft_model must be a checkpoint directory, got {self.draft_model!r}")
        if d in DRAFT_MODEL_DRAFTERS and self.draft_model is None and self.num_speculative_tokens > 0:
            raise ConfigError(f"drafter={d!r} needs draft_model=<its checkpoint directory>")
        if d not in DRAFT_MODEL_DRAFTERS and self.draft_model is not None:
            raise ConfigError(f"draft_model={self.draft_model!r}: applies to drafter in "
                              f"{DRAFT_MODEL_DRAFTERS} only, got drafter={d!r}")
        if self.draft_model is not None:
            self.draft_model = os.fspath(self.draft_model)
        lo = check_int("prompt_lookup_min", self.prompt_lookup_min, 1, optional=True)
        hi = check_int("prompt_lookup_max", self.prompt_lookup_max, 1, optional=True)
        if d != "ngram":
            given = [
                f"{n}={v!r}"
                for n, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi))
                if v is not None
            ]
            if given:
                raise ConfigError(
                    f"{', '.join(given)}: prompt lookup settings apply to drafter='ngram' only, "
                    f"got drafter={d!r}"
                )
            return
        lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        if lo > hi:
            raise ConfigError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

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
        if self.model is not None and not isinstance(self.model, str | os.PathLike):
            raise ConfigError(f"model must be a checkpoint folder path or None, got {self.model!r}")
        if not isinstance(self.engine, str) or self.engine not in ENGINES:
            raise ConfigError(f"engine must be 'reference' or 'async', got {self.engine!r}")
        self.dtype = check_dtype("dtype", self.dtype)
        self.device = check_device("device", self.device)
        self.seed = check_int("seed", self.seed, 0)
        self.graph_mode = graph_mode(self.graph_mode)
        self.recurrent_prefill_chunked = check_bool(
            "recurrent_prefill_chunked", self.recurrent_prefill_chunked
        )
        for name, kind in (("cache", CacheConfig), ("scheduler", SchedulerConfig),
                           ("speculative", SpeculativeConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if self.engine == "reference" and self.graph_mode is not GraphMode.NONE:
            raise ConfigError("graph_mode: the reference engine runs without graphs (graph_mode='none')")
        k = self.speculative.num_speculative_tokens
        if self.scheduler.max_num_batched_tokens < 1 + k:
            raise ConfigError(
                f"max_num_batched_tokens ({self.scheduler.max_num_batched_tokens}) must be >= 1 + "
                f"num_speculative_tokens ({1 + k}) so a verify row always fits"
            )
        if self.cache.enable_prefix_caching and self.recurrent_prefill_chunked:
            raise ConfigError("enable_prefix_caching=True with recurrent_prefill_chunked=True: the chunked "
                              "prefill kernels' results depend on where a prompt is split, so a prefix hit "
                              "could change the logits (use recurrent_prefill_chunked=False)")
        if self.cache.num_kv_blocks is not None and self.cache.num_kv_blocks < self.blocks_per_request:
            raise ConfigError(
                f"num_kv_blocks ({self.cache.num_kv_blocks}) cannot hold one request of max_model_len "
                f"{self.scheduler.max_model_len}: needs {self.blocks_per_request} blocks "
                f"of {self.cache.block_size}"
            )

    @property
    def num_lookahead_tokens(self) -> int:
        """KV positions reserved past the verify tokens for the drafter's chained steps."""
        return self.speculative.num_speculative_tokens

    @property
    def kv_positions_per_request(self) -> int:
        """KV positions one request can ever write: up to ``max_model_len`` committed tokens, then a
        verify row of 1+K past the last one (work in flight when it finished) and the drafter's K-1
        chained positions: position ``max_model_len + 2K`` at most."""
        return self.scheduler.max_model_len + 2 * self.speculative.num_speculative_tokens + 1

    @property
    def blocks_per_request(self) -> int:
        """Blocks one request may need at most (the width of a block table row)."""
        return math.ceil(self.kv_positions_per_request / self.cache.block_size)

    @property
    def num_kv_blocks(self) -> int:
        if self.cache.num_kv_blocks is not None:
            return self.cache.num_kv_blocks
        per_seq = math.ceil(min(self.scheduler.max_model_len, 512) / self.cache.block_size) + 1
        return max(self.blocks_per_request, self.scheduler.max_num_seqs * per_seq)

    @property
    def num_state_slots(self) -> int:
        """Per-request state slots: s_0..s_K for every seat."""
        return self.scheduler.max_num_seqs * (1 + self.speculative.num_speculative_tokens)

    @property
    def num_checkpoint_columns(self) -> int:
        """Block boundaries one row of an async step can reach (P): its 1+K tokens cover at most this many."""
        return math.ceil((1 + self.speculative.num_speculative_tokens) / self.cache.block_size)

    @property
    def num_staged_checkpoints(self) -> int:
        """State slots after the checkpoints that the async engine's steps in flight copy boundary states
        into before the host knows their keys: P per row of the two steps that can hold them at once
        (the one planned and the one in flight). 0 for the reference engine and without caching."""
        if not self.cache.enable_prefix_caching or self.engine != "async":
            return 0
        return 2 * self.scheduler.max_num_seqs * self.num_checkpoint_columns

    @property
    def num_state_checkpoints(self) -> int:
        """State slots after the per-request ones that hold prefix-cache checkpoints (0 without caching)."""
        if not self.cache.enable_prefix_caching:
            return 0
        n = self.cache.num_state_checkpoints
        return self.num_kv_blocks if n is None else n
