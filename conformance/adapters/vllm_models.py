"""The tiny presets in a geometry vLLM's CPU build loads (``--engine vllm --model tiny:<preset>``).

vLLM's CPU kernels take attention heads of 32 and up, GDN key/value heads of 64 or 128 (bfloat16 only),
no non-gated (relu2) MoE, and a Qwen3-Next with at least one MoE layer; its Qwen3-Next and Nemotron-H
classes never tie embeddings. The presets here are each family's tiny preset with just those fields
changed, written by transformers' own ``save_pretrained`` with the families' seeded weights, given the
family's MTP head and the byte-level tokenizer as ``tiny:<preset>`` is (``refengine.tools.tiny_models``).
Each is written once per version into the temp folder, beside the presets.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from refengine.tools.folders import write_once
from refengine.tools.tiny_models import TINY_PREFIX

SUFFIX = "-vllm"


def _llama(out: Path) -> None:
    from refengine.model.llama import tiny

    tiny.write_seeded(out, "LlamaConfig", "LlamaForCausalLM",
                      {**tiny.LLAMA_CONFIG, "hidden_size": 128, "head_dim": 32})


def _qwen3(out: Path) -> None:
    from refengine.model.llama import tiny

    tiny.write_seeded(out, "Qwen3Config", "Qwen3ForCausalLM",
                      {**tiny.QWEN3_CONFIG, "hidden_size": 128, "head_dim": 32, "num_attention_heads": 4})


def _nemotron_h(out: Path) -> None:
    from refengine.model.nemotron_h import tiny

    # MLP blocks where the preset has MoE (relu2 experts: CUDA only in vLLM); an MTP head of one attention
    # block (vLLM's Nemotron-H MTP takes attention and MoE blocks only)
    tiny.write_tiny_checkpoint(out, {**tiny.TINY_CONFIG, "head_dim": 32,
                                     "layers_block_type": ["mamba", "attention", "mamba", "mlp"],
                                     "mtp_layers_block_type": ["attention"]})


def _qwen3_next(out: Path) -> None:
    import json
    from importlib.resources import files

    from refengine.model.llama import tiny

    cfg = json.loads((files("refengine") / "data" / "default_model" / "config.json").read_text())
    drop = ("architectures", "model_type", "dtype", "bos_token_id", "pad_token_id")
    cfg = {k: v for k, v in cfg.items() if k not in drop}
    cfg.update(head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64, tie_word_embeddings=False,
               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
               shared_expert_intermediate_size=64,
               mlp_only_layers=[0, 2], decoder_sparse_step=1, vocab_size=256, eos_token_id=2)
    tiny.write_seeded(out, "Qwen3NextConfig", "Qwen3NextForCausalLM", cfg)


WRITERS: dict[str, Callable[[Path], None]] = {"llama": _llama, "qwen3": _qwen3, "nemotron_h": _nemotron_h,
                                              "qwen3_next": _qwen3_next}


def vllm_preset_names() -> list[str]:
    return [TINY_PREFIX + name + SUFFIX for name in WRITERS]


def vllm_model_path(name: str) -> str:
    """The folder of ``tiny:<preset>`` in vLLM's CPU geometry (``tiny:<preset>-vllm`` is the same), written
    on first use; ValueError for a preset without one."""
    preset = name[len(TINY_PREFIX):].removesuffix(SUFFIX)
    if preset not in WRITERS:
        raise ValueError(f"no vLLM geometry of {name!r}; there is one of {', '.join(vllm_preset_names())}")
    folder = f"conformance-tiny-{preset}{SUFFIX}-{_version(preset)}-uid{os.getuid()}"
    root = Path(tempfile.gettempdir()) / folder
    write_once(root, lambda work: _make(preset, work))
    return str(root)


def _version(preset: str) -> str:
    import transformers

    from refengine.tools import mtp_head, tiny_models

    digest = hashlib.sha256(transformers.__version__.encode())
    sources = {__file__, tiny_models.__file__, mtp_head.__file__}
    from refengine.model.registry import FAMILIES

    for f in FAMILIES:
        for _, writer in f.tiny_checkpoints:
            sources.add(inspect.getsourcefile(writer))
        if f.mtp_head is not None:
            sources.add(inspect.getsourcefile(f.mtp_head))
    for source in sorted(sources):
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:12]


def _make(preset: str, work: Path) -> None:
    from refengine.model.loader import read_config
    from refengine.model.registry import family_for
    from refengine.tools.mtp_head import add_mtp_head
    from refengine.tools.tiny_models import _write_tokenizer

    WRITERS[preset](work / "src")
    if family_for(read_config(work / "src").model_type).mtp_head is not None:
        add_mtp_head(work / "src", work / "out")
    else:
        shutil.copytree(work / "src", work / "out")
    _write_tokenizer(work / "out", read_config(work / "out").vocab_size)
