"""Model configuration for the Qwen3-Next / Qwen3.5 hybrid decoder.

``config.json`` is parsed by transformers' own configuration class for its ``model_type`` (offline:
nothing is fetched), so every default is transformers'. ``Qwen3NextConfig`` is the engine's validated
view of the fields it uses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from refengine.model.hf_config import transformers_config

LINEAR = "linear_attention"
FULL = "full_attention"
LAYER_TYPES = (LINEAR, FULL)

# model_type -> GDN projection layout on disk
GDN_LAYOUTS = {
    "qwen3_next": "qkvz",
    "qwen3_5_text": "split",
    "qwen3_5": "split",
    "qwen3_5_moe_text": "split",
    "qwen3_5_moe": "split",
}
# Qwen3.5 MoE has no dense layers: every layer is sparse and top-k weights are always renormalised.
ALL_MOE_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")


@dataclass(slots=True)
class Qwen3NextConfig:
    model_type: str  # a key of GDN_LAYOUTS
    vocab_size: int  # V
    hidden_size: int  # H
    num_hidden_layers: int  # L
    layer_types: list[str]  # [L] "linear_attention" | "full_attention"
    num_attention_heads: int  # Hq (full attention)
    num_key_value_heads: int  # Hkv (full attention)
    head_dim: int  # D (full attention)
    linear_num_key_heads: int  # Hk (GDN q/k heads)
    linear_num_value_heads: int  # Hv (GDN v heads)
    linear_key_head_dim: int  # Dk
    linear_value_head_dim: int  # Dv
    linear_conv_kernel_dim: int  # W (causal conv width)
    intermediate_size: int  # I (dense MLP width; 0 when no layer is dense)
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_ids: list[int] = field(default_factory=list)
    num_mtp_layers: int = 0  # the loader sets the count the checkpoint holds
    gdn_layout: str = "split"  # "qkvz" (Qwen3-Next on disk) | "split" (Qwen3.5 on disk)
    hidden_act: str = "silu"
    num_experts: int = 0  # E (0: no MoE layer)
    num_experts_per_tok: int = 0  # K (top-k)
    moe_intermediate_size: int = 0  # Ie (routed expert width)
    shared_expert_intermediate_size: int = 0  # Is (shared expert width)
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1
    mlp_only_layers: list[int] = field(default_factory=list)
    decoder_sparse_step: int = 1

    def __post_init__(self) -> None:
        if self.model_type not in GDN_LAYOUTS:
            raise ValueError(
                f"model_type: unsupported {self.model_type!r}, expected one of {sorted(GDN_LAYOUTS)}"
            )
        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "max_position_embeddings", "decoder_sparse_step",
        ):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "shared_expert_intermediate_size"):
            _check_int(name, getattr(self, name), minimum=0)
        if self.linear_conv_kernel_dim < 2:
            raise ValueError(f"linear_conv_kernel_dim: must be >= 2, got {self.linear_conv_kernel_dim}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads: {self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads {self.linear_num_key_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads: {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types: has {len(self.layer_types)} entries, "
                f"num_hidden_layers is {self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ValueError(f"layer_types: unknown layer type {kind!r} at layer {i}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor: must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor: rotary dim int(head_dim * factor) = {self.rotary_dim} "
                "must be even and >= 2"
            )
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta: must be positive, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps: must be positive, got {self.rms_norm_eps}")
        if self.num_mtp_layers < 0:
            raise ValueError(f"num_mtp_layers: must be >= 0, got {self.num_mtp_layers}")
        if self.gdn_layout not in ("qkvz", "split"):
            raise ValueError(f"gdn_layout: must be 'qkvz' or 'split', got {self.gdn_layout!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {self.hidden_act!r}")
        for tok in self.eos_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < self.vocab_size:
                raise ValueError(
                    f"eos_token_ids: {tok!r} is not a token id below vocab_size {self.vocab_size}"
                )
        if self.num_experts > 0:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok: must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_tok}"
                )
            for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"{name}: must be a positive integer when num_experts > 0")
        layers = range(self.num_hidden_layers)
        if any(not self.is_moe_layer(i) for i in layers) and self.intermediate_size <= 0:
            raise ValueError("intermediate_size: must be a positive integer (the model has dense MLP layers)")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:  # rd, leading dims of each head that RoPE rotates
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:  # Hk * Dk
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:  # Hv * Dv
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:  # C = 2 * Hk * Dk + Hv * Dv, channels of the conv ([q | k | v])
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def linear_layer_ids(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == LINEAR]

    @property
    def full_layer_ids(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == FULL]

    def is_moe_layer(self, index: int) -> bool:
        """transformers' rule: MoE iff experts exist, the layer is not forced dense and (i+1) % step == 0.

        The MTP layers follow the same rule with their own index (mtp.layers.{i}), as vLLM builds them.
        """
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> Qwen3NextConfig:
        """Build from a parsed config.json, through transformers' configuration class for its model_type."""
        if not isinstance(d, dict):
            raise TypeError(f"config: expected a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in GDN_LAYOUTS:
            raise ValueError(f"model_type: unsupported {model_type!r}, expected one of {sorted(GDN_LAYOUTS)}")
        config_class = _transformers_config_classes()[model_type]
        hf = transformers_config(config_class, dict(d))
        return cls.from_transformers(hf)

    @classmethod
    def from_transformers(cls, hf: Any) -> Qwen3NextConfig:
        """The engine's view of a transformers config (Qwen3Next / Qwen3_5[Moe] [Text]Config)."""
        model_type = hf.model_type
        if model_type not in GDN_LAYOUTS:
            raise ValueError(f"model_type: unsupported {model_type!r}, expected one of {sorted(GDN_LAYOUTS)}")
        text = hf.get_text_config(decoder=True)

        def get(name: str, default: Any = None) -> Any:  # text config first, then the top level
            value = getattr(text, name, None)
            return getattr(hf, name, default) if value is None else value

        if get("attention_bias", False):
            raise NotImplementedError("attention_bias: biased attention projections are not supported")
        theta, factor = _rope(get("rope_parameters"))
        eos = get("eos_token_id")
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        mtp = get("num_nextn_predict_layers", None) or get("mtp_num_hidden_layers", 0) or 0
        all_moe = model_type in ALL_MOE_MODEL_TYPES
        num_experts = get("num_experts", 0) or 0
        return cls(
            model_type=model_type,
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size"),
            num_hidden_layers=get("num_hidden_layers"),
            layer_types=list(get("layer_types")),
            num_attention_heads=get("num_attention_heads"),
            num_key_value_heads=get("num_key_value_heads"),
            head_dim=get("head_dim"),
            linear_num_key_heads=get("linear_num_key_heads"),
            linear_num_value_heads=get("linear_num_value_heads"),
            linear_key_head_dim=get("linear_key_head_dim"),
            linear_value_head_dim=get("linear_value_head_dim"),
            linear_conv_kernel_dim=get("linear_conv_kernel_dim"),
            intermediate_size=0 if all_moe else get("intermediate_size"),
            rope_theta=theta,
            partial_rotary_factor=factor,
            rms_norm_eps=float(get("rms_norm_eps")),
            tie_word_embeddings=bool(
                hf.tie_word_embeddings
            ),  # the top level governs a wrapped model, as in HF
            max_position_embeddings=get("max_position_embeddings"),
            eos_token_ids=eos_ids,
            num_mtp_layers=int(mtp),
            gdn_layout=GDN_LAYOUTS[model_type],
            hidden_act=get("hidden_act"),
            num_experts=num_experts,
            num_experts_per_tok=get("num_experts_per_tok", 0) if num_experts else 0,
            moe_intermediate_size=get("moe_intermediate_size", 0) if num_experts else 0,
            shared_expert_intermediate_size=get("shared_expert_intermediate_size", 0) if num_experts else 0,
            norm_topk_prob=True if all_moe else bool(get("norm_topk_prob", True)),
            mlp_only_layers=[] if all_moe else list(get("mlp_only_layers") or []),
            decoder_sparse_step=1 if all_moe else get("decoder_sparse_step", 1),
        )


def layer_types_given(raw: dict[str, Any]) -> bool:
    """Whether a parsed config.json states ``layer_types`` (top level or ``text_config``); without
    them transformers derives the layer types from ``full_attention_interval``."""
    text = raw.get("text_config")
    return raw.get("layer_types") is not None or (
        isinstance(text, dict) and text.get("layer_types") is not None
    )


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else "an integer >= 0"
        raise ValueError(f"{name}: must be {kind}, got {value!r}")


def _transformers_config_classes() -> dict[str, Any]:
    """transformers' configuration classes by model_type (imported lazily, hub kept offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import CONFIG_MAPPING

    return {model_type: CONFIG_MAPPING[model_type] for model_type in GDN_LAYOUTS}


def _rope(params: Any) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from transformers' standardised rope_parameters."""
    if not isinstance(params, dict):
        raise TypeError("rope_parameters: expected a JSON object")
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise NotImplementedError(
            f"rope_parameters: rope_type {rope_type!r} is not supported (only 'default')"
        )
    return float(params.get("rope_theta", 10000.0)), float(params.get("partial_rotary_factor", 1.0))
