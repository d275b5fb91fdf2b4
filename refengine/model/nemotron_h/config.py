"""Model configuration for Nemotron-H (``model_type`` ``nemotron_h``): Mamba2, attention, MLP and MoE blocks.

``config.json`` is parsed by transformers' configuration class of the same name (offline), so every
default is transformers'; ``NemotronHConfig`` here is the engine's validated view of the fields it uses. The
layer layout comes from ``layers_block_type`` or the legacy ``hybrid_override_pattern`` (one letter per
layer: ``M`` Mamba2, ``*`` attention, ``-`` MLP, ``E`` MoE).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from refengine.model.hf_config import transformers_config

MODEL_TYPE = "nemotron_h"
MAMBA = "mamba"
ATTENTION = "attention"
MLP = "mlp"
MOE = "moe"
# pattern letter -> block kind; transformers' block type names -> block kind
PATTERN_LETTERS = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
BLOCK_TYPE_NAMES = {
    "linear_attention": MAMBA, "mamba": MAMBA,
    "full_attention": ATTENTION, "attention": ATTENTION,
    "mlp": MLP, "moe": MOE,
}
FLOAT_TAGS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}
LETTERS = {kind: letter for letter, kind in PATTERN_LETTERS.items()}


@dataclass(slots=True)
class NemotronHConfig:
    vocab_size: int  # V
    hidden_size: int  # H
    block_kinds: list[str]  # [L] "mamba" | "attention" | "mlp" | "moe"
    num_attention_heads: int  # Hq
    num_key_value_heads: int  # Hkv
    head_dim: int  # D
    mamba_num_heads: int  # Hm (heads of the SSM)
    mamba_head_dim: int  # P
    ssm_state_size: int  # N
    n_groups: int  # G (B/C groups; head h reads group h // (Hm / G))
    conv_kernel: int  # W
    chunk_size: int  # chunk of the chunked prefill scan
    intermediate_size: int  # I of the '-' MLP layers (0 when there is none)
    use_conv_bias: bool = True
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: list[int] = field(default_factory=list)
    n_routed_experts: int = 0  # E
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # Ie
    moe_shared_expert_intermediate_size: int = 0  # Is
    # shared experts per MoE block, read as vLLM reads it: one relu² MLP of width Is x n_shared_experts
    # (0: none); transformers ignores the field and builds one of width Is
    n_shared_experts: int = 1
    moe_latent_size: int | None = None  # Lt: the routed experts run in this width (None: H)
    n_group: int = 1  # expert groups of the grouped top-k
    topk_group: int = 1  # groups kept per token
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    model_type: str = MODEL_TYPE
    num_mtp_layers: int = 0  # 1 when the checkpoint holds mtp.* tensors (set by the loader), else 0
    # MTP steps config.json records (transformers' default 0); vLLM builds its head only for 1, so a
    # checkpoint with an MTP head and another count is refused by the loader (0: not recorded)
    num_nextn_predict_layers: int = 0
    # block kinds of the MTP step (transformers' ``mtp_layers_block_type``; vLLM's
    # ``mtp_hybrid_override_pattern``), default attention then MoE
    mtp_block_kinds: list[str] = field(default_factory=lambda: [ATTENTION, MOE])

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "chunk_size",
                     "max_position_embeddings", "n_group", "topk_group"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("intermediate_size", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "moe_shared_expert_intermediate_size", "n_shared_experts"):
            _check_int(name, getattr(self, name), minimum=0)
        if not self.block_kinds:
            raise ValueError("layers_block_type: the model has no layers")
        for i, kind in enumerate(self.block_kinds):
            if kind not in LETTERS:
                raise ValueError(f"layers_block_type: unknown block kind {kind!r} at layer {i}")
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel: must be >= 2, got {self.conv_kernel}")
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(f"mamba_num_heads: {self.mamba_num_heads} is not a multiple of n_groups "
                             f"{self.n_groups} (each group of B/C serves mamba_num_heads / n_groups heads)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads: {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if not self.layer_norm_epsilon > 0:
            raise ValueError(f"layer_norm_epsilon: must be positive, got {self.layer_norm_epsilon}")
        if MLP in self.block_kinds and self.intermediate_size <= 0:
            raise ValueError("intermediate_size: must be a positive integer (the model has '-' MLP layers)")
        for i, kind in enumerate(self.mtp_block_kinds):
            if kind not in (ATTENTION, MOE, MLP):
                raise ValueError(f"mtp_layers_block_type: block kind {kind!r} at MTP layer {i} is not "
                                 "supported (attention, moe, mlp)")
        if self.mtp_block_kinds.count(ATTENTION) > 1:
            raise ValueError("mtp_layers_block_type: at most one attention layer per MTP step "
                             f"(it owns the drafter's KV cache), got {self.mtp_block_kinds}")
        if MOE in self.block_kinds:
            self._check_moe()
        for tok in self.eos_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < self.vocab_size:
                raise ValueError(
                    f"eos_token_ids: {tok!r} is not a token id below vocab_size {self.vocab_size}"
                )

    def _check_moe(self) -> None:
        experts = self.n_routed_experts
        for name in ("n_routed_experts", "moe_intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be a positive integer (the model has 'E' MoE layers)")
        if self.n_shared_experts and self.moe_shared_expert_intermediate_size <= 0:
            raise ValueError("moe_shared_expert_intermediate_size: must be a positive integer (the 'E' MoE "
                             f"layers have n_shared_experts {self.n_shared_experts})")
        if self.moe_latent_size is not None:
            _check_int("moe_latent_size", self.moe_latent_size, minimum=1)
        if experts % self.n_group:
            raise ValueError(f"n_routed_experts: {experts} is not a multiple of n_group {self.n_group}")
        if self.n_group > 1 and experts // self.n_group < 2:
            raise ValueError(f"n_group: {self.n_group} groups of {experts // self.n_group} expert(s); the "
                             "grouped top-k scores a group by its two best experts")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group: {self.topk_group} exceeds n_group {self.n_group}")
        selectable = self.topk_group * (experts // self.n_group)
        if not 1 <= self.num_experts_per_tok <= selectable:
            raise ValueError(f"num_experts_per_tok: must be in [1, {selectable}] (topk_group x experts per "
                             f"group), got {self.num_experts_per_tok}")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor: must be positive, got {self.routed_scaling_factor}")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def num_hidden_layers(self) -> int:  # L
        return len(self.block_kinds)

    @property
    def pattern(self) -> str:  # one letter per layer, e.g. "M*M-ME"
        return "".join(LETTERS[kind] for kind in self.block_kinds)

    @property
    def mamba_intermediate_size(self) -> int:  # I = Hm * P
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:  # C = I + 2 G N, channels of the conv ([x | B | C])
        return self.mamba_intermediate_size + 2 * self.n_groups * self.ssm_state_size

    @property
    def shared_expert_intermediate_size(self) -> int:  # the shared expert's width, as vLLM reads the config
        return self.moe_shared_expert_intermediate_size * self.n_shared_experts

    @property
    def experts_width(self) -> int:  # width the routed experts read and write (latent or hidden)
        return self.moe_latent_size if self.moe_latent_size is not None else self.hidden_size

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> NemotronHConfig:
        """Build from a parsed config.json, through transformers' NemotronHConfig."""
        if not isinstance(d, dict):
            raise TypeError(f"config: expected a JSON object, got {type(d).__name__}")
        _check_layout(d)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import CONFIG_MAPPING

        config_class = CONFIG_MAPPING[MODEL_TYPE]
        hf = transformers_config(config_class, _decode_floats(dict(d)))
        return cls.from_transformers(hf)

    @classmethod
    def from_transformers(cls, hf: Any) -> NemotronHConfig:
        """The engine's view of a transformers ``NemotronHConfig``."""
        for name in ("use_bias", "mlp_bias", "attention_bias"):
            if getattr(hf, name, False):
                raise NotImplementedError(f"{name}: biased projections are not supported")
        for name, want in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
            if getattr(hf, name) != want:
                raise ValueError(f"{name}: only {want!r} is supported, got {getattr(hf, name)!r}")
        if getattr(hf, "sliding_window", None) is not None:
            raise NotImplementedError("sliding_window: windowed attention is not supported")
        eos = hf.eos_token_id
        kinds = [BLOCK_TYPE_NAMES[t] for t in hf.layers_block_type]
        mtp_names = getattr(hf, "mtp_layers_block_type", None) or ["full_attention", "moe"]
        unknown = [t for t in mtp_names if t not in BLOCK_TYPE_NAMES]
        if unknown:
            raise ValueError(f"mtp_layers_block_type: unknown block type {unknown[0]!r}")
        mtp_kinds = [BLOCK_TYPE_NAMES[t] for t in mtp_names]
        moe = MOE in kinds or MOE in mtp_kinds  # an MTP MoE layer uses the model's MoE fields
        latent = getattr(hf, "moe_latent_size", None)
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            block_kinds=kinds,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=hf.num_key_value_heads,
            head_dim=hf.head_dim,
            mamba_num_heads=hf.mamba_num_heads,
            mamba_head_dim=hf.mamba_head_dim,
            ssm_state_size=hf.ssm_state_size,
            n_groups=hf.n_groups,
            conv_kernel=hf.conv_kernel,
            chunk_size=hf.chunk_size,
            intermediate_size=hf.intermediate_size if MLP in kinds or MLP in mtp_kinds else 0,
            use_conv_bias=bool(hf.use_conv_bias),
            layer_norm_epsilon=float(hf.layer_norm_epsilon),
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            max_position_embeddings=hf.max_position_embeddings,
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
            n_routed_experts=hf.n_routed_experts if moe else 0,
            num_experts_per_tok=hf.num_experts_per_tok if moe else 0,
            moe_intermediate_size=hf.moe_intermediate_size if moe else 0,
            moe_shared_expert_intermediate_size=hf.moe_shared_expert_intermediate_size if moe else 0,
            n_shared_experts=hf.n_shared_experts if moe else 0,
            moe_latent_size=latent if moe else None,
            n_group=hf.n_group,
            topk_group=hf.topk_group,
            norm_topk_prob=bool(hf.norm_topk_prob),
            routed_scaling_factor=float(hf.routed_scaling_factor),
            mtp_block_kinds=mtp_kinds,
            num_nextn_predict_layers=hf.num_nextn_predict_layers,
        )


def _check_layout(d: dict[str, Any]) -> None:
    """Name a bad ``hybrid_override_pattern`` letter or ``layers_block_type`` entry before transformers
    sees it (it would raise a bare KeyError for the letter)."""
    types = d.get("layers_block_type")
    if types is not None:
        if not isinstance(types, list):
            raise TypeError(f"layers_block_type: expected a list of block types, got {type(types).__name__}")
        for i, name in enumerate(types):
            if name not in BLOCK_TYPE_NAMES:
                raise ValueError(f"layers_block_type: unknown block type {name!r} at layer {i}; known: "
                                 f"{', '.join(BLOCK_TYPE_NAMES)}")
        return
    pattern = d.get("hybrid_override_pattern")
    if pattern is None:
        return
    if not isinstance(pattern, str):
        raise TypeError(f"hybrid_override_pattern: expected a string, got {type(pattern).__name__}")
    for i, letter in enumerate(pattern):
        if letter not in PATTERN_LETTERS:
            known = ", ".join(f"{k} ({v})" for k, v in PATTERN_LETTERS.items())
            raise ValueError(f"hybrid_override_pattern: unknown letter {letter!r} at layer {i} of "
                             f"{pattern!r}; known: {known}")


def _decode_floats(obj: Any) -> Any:
    """transformers writes inf / nan in config.json as ``{"__float__": "Infinity"}`` (its
    ``time_step_limit`` default is (0, inf)); decode them as its own JSON reader does."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in FLOAT_TAGS:
            return FLOAT_TAGS[obj["__float__"]]
        return {k: _decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_floats(v) for v in obj]
    return obj


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else "an integer >= 0"
        raise ValueError(f"{name}: must be {kind}, got {value!r}")
