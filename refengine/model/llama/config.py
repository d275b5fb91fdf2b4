"""Model configuration for dense attention decoders: Llama (``model_type`` ``llama``, Llama-2/3.x with or
without the ``llama3`` RoPE scaling) and Qwen3 dense (``qwen3``: per-head q/k RMSNorm before RoPE).

``config.json`` is parsed by transformers' own configuration class for its ``model_type`` (offline), so
every default is transformers' (Qwen3's ``head_dim`` defaults to 128, Llama's to hidden / heads), and its
legacy ``rope_scaling`` is read as transformers standardises it into ``rope_parameters``.
``LlamaConfig`` is the engine's validated view of the fields it uses; a bad field is named.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from refengine.model.hf_config import transformers_config

LLAMA = "llama"
QWEN3 = "qwen3"
MODEL_TYPES = (LLAMA, QWEN3)
DEFAULT_ROPE = "default"
LLAMA3_ROPE = "llama3"
ROPE_TYPES = (DEFAULT_ROPE, LLAMA3_ROPE)
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True, slots=True)
class Llama3Scaling:
    """Llama-3.1's RoPE frequency scaling: long wavelengths slowed by ``factor``, short ones kept, the band
    between interpolated (wavelengths measured against ``original_max_position_embeddings``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        field_name = "rope_parameters"
        if not self.factor > 0:
            raise ValueError(f"{field_name}: llama3 factor must be positive, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"{field_name}: llama3 needs 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor} and {self.high_freq_factor}")
        _check_int(f"{field_name}: llama3 original_max_position_embeddings",
                   self.original_max_position_embeddings, minimum=1)


@dataclass(slots=True)
class LlamaConfig:
    model_type: str  # "llama" | "qwen3"
    vocab_size: int  # V
    hidden_size: int  # H
    num_hidden_layers: int  # L
    num_attention_heads: int  # Hq
    num_key_value_heads: int  # Hkv
    head_dim: int  # D
    intermediate_size: int  # I (SwiGLU width)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Llama3Scaling | None = None  # None: plain RoPE
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    eos_token_ids: list[int] = field(default_factory=list)
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type: unsupported {self.model_type!r}, "
                             f"expected one of {list(MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings"):
            _check_int(name, getattr(self, name), minimum=1)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads: {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: RoPE rotates pairs of dims, so it must be even, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps: must be positive, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta: must be positive, got {self.rope_theta}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {self.hidden_act!r}")
        for tok in self.eos_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < self.vocab_size:
                raise ValueError(
                    f"eos_token_ids: {tok!r} is not a token id below vocab_size {self.vocab_size}"
                )

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> LlamaConfig:
        """Build from a parsed config.json, through transformers' configuration class for its model_type."""
        if not isinstance(d, dict):
            raise TypeError(f"config: expected a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type: unsupported {model_type!r}, expected one of {list(MODEL_TYPES)}")
        _check_rope_type(d)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import CONFIG_MAPPING

        config_class = CONFIG_MAPPING[model_type]
        hf = transformers_config(config_class, dict(d))
        return cls.from_transformers(hf)

    @classmethod
    def from_transformers(cls, hf: Any) -> LlamaConfig:
        """The engine's view of a transformers ``LlamaConfig`` / ``Qwen3Config``."""
        model_type = hf.model_type
        for name in ("attention_bias", "mlp_bias"):
            if getattr(hf, name, False):
                raise ValueError(f"{name}: biased projections are not supported")
        if getattr(hf, "use_sliding_window", False):
            raise ValueError("use_sliding_window: windowed attention is not supported")
        kinds = set(getattr(hf, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise ValueError(
                f"layer_types: only full_attention layers are supported, got {sorted(kinds)}"
            )
        if getattr(hf, "pretraining_tp", 1) not in (None, 1):
            raise ValueError(f"pretraining_tp: only 1 is supported, got {hf.pretraining_tp!r}")
        theta, scaling = _rope(hf.rope_parameters)
        eos = hf.eos_token_id
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None)
        if head_dim is None and isinstance(heads, int) and heads > 0:
            head_dim = hf.hidden_size // heads
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=hf.num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=hf.intermediate_size,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=scaling,
            qk_norm=model_type == QWEN3,
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            max_position_embeddings=hf.max_position_embeddings,
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
            hidden_act=hf.hidden_act,
        )


def _check_rope_type(d: dict[str, Any]) -> None:
    """Name an unsupported RoPE type before transformers sees it (it only warns about an unknown one)."""
    for name in ("rope_parameters", "rope_scaling"):
        params = d.get(name)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise TypeError(f"{name}: expected a JSON object, got {type(params).__name__}")
        rope_type = params.get("rope_type", params.get("type", DEFAULT_ROPE))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{name}: rope_type {rope_type!r} is not supported "
                                      f"(supported: {', '.join(ROPE_TYPES)})")


def _rope(params: Any) -> tuple[float, Llama3Scaling | None]:
    """(rope_theta, the llama3 scaling or None) from transformers' standardised ``rope_parameters``."""
    if not isinstance(params, dict):
        raise TypeError("rope_parameters: expected a JSON object")
    rope_type = params.get("rope_type", DEFAULT_ROPE)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_parameters: rope_type {rope_type!r} is not supported "
                                  f"(supported: {', '.join(ROPE_TYPES)})")
    factor = params.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise ValueError(f"rope_parameters: partial_rotary_factor {factor!r} is not supported "
                                  "(RoPE rotates the whole head)")
    theta = float(params.get("rope_theta", 10000.0))
    if rope_type == DEFAULT_ROPE:
        return theta, None
    missing = [k for k in LLAMA3_KEYS if params.get(k) is None]
    if missing:
        raise ValueError(f"rope_parameters: llama3 scaling needs {', '.join(missing)}")
    return theta, Llama3Scaling(float(params["factor"]), float(params["low_freq_factor"]),
                                float(params["high_freq_factor"]), params["original_max_position_embeddings"])


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else "an integer >= 0"
        raise ValueError(f"{name}: must be {kind}, got {value!r}")
