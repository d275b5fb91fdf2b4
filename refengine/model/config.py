"""Model configuration for the Qwen3-Next / Qwen3.5 hybrid decoder, read from a HF config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LINEAR = "linear_attention"
FULL = "full_attention"
LAYER_TYPES = (LINEAR, FULL)

# model_type -> GDN projection layout on disk
GDN_LAYOUTS = {"qwen3_next": "qkvz", "qwen3_5_text": "split", "qwen3_5": "split"}
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")

MOE_UNSUPPORTED = "MoE layers are not supported yet"


@dataclass(slots=True)
class ModelConfig:
    model_type: str  # "qwen3_next" | "qwen3_5_text" | "qwen3_5"
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
    intermediate_size: int  # I (dense MLP width)
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_ids: list[int] = field(default_factory=list)
    num_mtp_layers: int = 0  # the loader sets the count the checkpoint holds
    gdn_layout: str = "split"  # "qkvz" (Qwen3-Next on disk) | "split" (Qwen3.5 on disk)
    hidden_act: str = "silu"
    num_experts: int = 0
    mlp_only_layers: list[int] = field(default_factory=list)
    decoder_sparse_step: int = 1

    def __post_init__(self) -> None:
        if self.model_type in MOE_MODEL_TYPES:
            raise NotImplementedError(f"{MOE_UNSUPPORTED} (model_type {self.model_type!r})")
        if self.model_type not in GDN_LAYOUTS:
            raise ValueError(f"model_type: unsupported {self.model_type!r}, expected one of {sorted(GDN_LAYOUTS)}")
        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "intermediate_size", "max_position_embeddings", "decoder_sparse_step",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
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
                f"layer_types: has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ValueError(f"layer_types: unknown layer type {kind!r} at layer {i}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor: must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor: rotary dim int(head_dim * factor) = {self.rotary_dim} must be even and >= 2"
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
                raise ValueError(f"eos_token_ids: {tok!r} is not a token id below vocab_size {self.vocab_size}")
        if self.num_experts < 0:
            raise ValueError(f"num_experts: must be >= 0, got {self.num_experts}")
        for i in range(self.num_hidden_layers):
            if self.is_moe_layer(i):
                raise NotImplementedError(f"{MOE_UNSUPPORTED} (layer {i}: num_experts={self.num_experts})")

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
        """HF's rule: MoE iff experts exist, the layer is not forced dense and (i+1) % step == 0."""
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a parsed config.json (model_type qwen3_next, qwen3_5_text or qwen3_5)."""
        if not isinstance(d, dict):
            raise TypeError(f"config: expected a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type in MOE_MODEL_TYPES:
            raise NotImplementedError(f"{MOE_UNSUPPORTED} (model_type {model_type!r})")
        text = d
        if isinstance(d.get("text_config"), dict):
            text = d["text_config"]
            if text.get("model_type") in MOE_MODEL_TYPES:
                raise NotImplementedError(f"{MOE_UNSUPPORTED} (model_type {text['model_type']!r})")
        if model_type not in GDN_LAYOUTS:
            raise ValueError(f"model_type: unsupported {model_type!r}, expected one of {sorted(GDN_LAYOUTS)}")

        def get(name: str, default: Any = None) -> Any:  # text_config first, then the top level
            return text[name] if name in text else d.get(name, default)

        missing = [
            n for n in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "intermediate_size")
            if get(n) is None
        ]
        if missing:
            raise ValueError(f"{missing[0]}: required config field is missing")
        if get("attention_bias", False):
            raise NotImplementedError("attention_bias: biased attention projections are not supported")

        num_layers = get("num_hidden_layers")
        layer_types = get("layer_types")
        if layer_types is None:
            interval = get("full_attention_interval", 4)
            if not isinstance(interval, int) or interval <= 0:
                raise ValueError(f"full_attention_interval: must be a positive integer, got {interval!r}")
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]

        theta, factor = _rope(get)
        eos = get("eos_token_id")
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        mtp = get("num_nextn_predict_layers", get("mtp_num_hidden_layers", 0)) or 0
        # Top-level tie flag governs the wrapped (multimodal) model, as in HF.
        tie = d.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return cls(
            model_type=model_type,
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size"),
            num_hidden_layers=num_layers,
            layer_types=list(layer_types),
            num_attention_heads=get("num_attention_heads"),
            num_key_value_heads=get("num_key_value_heads"),
            head_dim=get("head_dim") or get("hidden_size") // get("num_attention_heads"),
            linear_num_key_heads=get("linear_num_key_heads", 16),
            linear_num_value_heads=get("linear_num_value_heads", 32),
            linear_key_head_dim=get("linear_key_head_dim", 128),
            linear_value_head_dim=get("linear_value_head_dim", 128),
            linear_conv_kernel_dim=get("linear_conv_kernel_dim", 4),
            intermediate_size=get("intermediate_size"),
            rope_theta=theta,
            partial_rotary_factor=factor,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(tie),
            max_position_embeddings=get("max_position_embeddings", 32768),
            eos_token_ids=eos_ids,
            num_mtp_layers=int(mtp),
            gdn_layout=GDN_LAYOUTS[model_type],
            hidden_act=get("hidden_act", "silu"),
            num_experts=get("num_experts", 0) or 0,
            mlp_only_layers=list(get("mlp_only_layers") or []),
            decoder_sparse_step=get("decoder_sparse_step", 1) or 1,
        )


def _rope(get) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from rope_parameters, else legacy top-level keys."""
    params = get("rope_parameters") or {}
    legacy = get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(legacy, dict):
        raise TypeError("rope_parameters: expected a JSON object")
    rope_type = params.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    if rope_type != "default":
        raise NotImplementedError(f"rope_parameters: rope_type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", get("partial_rotary_factor", 0.25))
    return float(theta), float(factor)
