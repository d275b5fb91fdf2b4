"""How Llama and Qwen3 checkpoints name and lay out their tensors: as the model holds them
(``model.*``, ``lm_head.weight``), so the mapping is the identity. An old checkpoint's
``rotary_emb.inv_freq`` buffers are skipped (the model recomputes the frequencies from the config)."""

from __future__ import annotations

import torch

from refengine.model.llama.config import LlamaConfig

SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaWeights:
    """The weight-name mapping of the dense family (see ``refengine.model.registry.FamilyWeights``)."""

    embed_name = "model.embed_tokens.weight"

    @staticmethod
    def model_name(key: str) -> str | None:
        return None if key.endswith(SKIPPED_SUFFIXES) else key

    @staticmethod
    def as_in_file(names: list[str], file_names: dict[str, str]) -> list[str]:
        return [file_names.get(name, name) for name in names]

    @staticmethod
    def prepare(cfg: LlamaConfig, tensors: dict[str, torch.Tensor]) -> None:
        return None

    @staticmethod
    def expected_shapes(model, cfg: LlamaConfig, names: set[str]) -> dict[str, tuple[int, ...]]:
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        if cfg.tie_word_embeddings:
            del shapes["lm_head.weight"]
        return shapes

    @staticmethod
    def mismatch_note(raw: dict, tensors: dict[str, torch.Tensor], cfg: LlamaConfig) -> str:
        norms = "with" if cfg.qk_norm else "without"
        return (f"; the config is a {cfg.model_type} model of {cfg.num_hidden_layers} layers, "
                f"{norms} q/k norms")

    @staticmethod
    def to_model_layout(tensors: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
        return dict(tensors)

    @staticmethod
    def keep_fp32(name: str) -> bool:
        return False
