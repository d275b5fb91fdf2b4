"""Degenerate checkpoints are refused at load, naming the tensor as the file does (its name, its dtype
on disk, for fused experts the expert and projection); a flag allows them for debugging."""

from __future__ import annotations

import re

import pytest
import torch

from refengine import LLM, SamplingParams
from refengine.model import CheckpointError, load_model
from tests.helpers.checkpoints import fuse_experts, read_tensors, write_variant

NAME = "model.layers.1.mlp.up_proj.weight"


def _with_value(src, dst, value: float, name: str = NAME, index=(3, 5), tensors=None, dtype=None):
    """A copy of checkpoint ``src`` (or of ``tensors``, its tensors changed) with ``tensors[name][index] =
    value``,
    every tensor in ``dtype`` when given."""
    tensors = dict(read_tensors(src) if tensors is None else tensors)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    tensors[name] = tensors[name].clone()
    tensors[name][index] = value
    return write_variant(src, dst, tensors)


def _message(path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        load_model(path, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("value,kind", [(float("nan"), "1 NaN, 0 Inf"), (float("inf"), "0 NaN, 1 Inf"),
                                        (float("-inf"), "0 NaN, 1 Inf")])
def test_non_finite_weight_is_refused_by_name(value, kind, tiny_checkpoint, tmp_path):
    path = _with_value(tiny_checkpoint("next-tiny"), tmp_path / "bad", value)
    assert _message(path).startswith(
        f"tensor {NAME} (float32 on disk) holds non-finite values: {kind} of 8192; "
    )
    with pytest.raises(CheckpointError, match=f"tensor {NAME}.*allow_non_finite_weights=True"):
        LLM(model=str(path))


def test_the_dtype_named_is_the_files(tiny_checkpoint, tmp_path):
    """A bfloat16 checkpoint loaded in float32: the message says bfloat16, what the file holds."""
    path = _with_value(tiny_checkpoint("next-tiny"), tmp_path / "bf16", float("nan"), dtype=torch.bfloat16)
    assert _message(path, dtype=torch.float32).startswith(
        f"tensor {NAME} (bfloat16 on disk) holds non-finite"
    )


def test_a_fused_gdn_projection_is_named_as_on_disk(tiny_checkpoint, tmp_path):
    """Qwen3-Next's in_proj_qkvz is split in memory; the message names the file's fused tensor."""
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    path = _with_value(tiny_checkpoint("next-tiny"), tmp_path / "bad", float("inf"), name, index=(150, 7))
    assert _message(path).startswith(
        f"tensor {name} (float32 on disk) holds non-finite values: 0 NaN, 1 Inf of "
    )


def test_a_per_expert_tensor_is_named_with_its_expert(tiny_checkpoint, tmp_path):
    """The count is that expert's projection, not the fused tensor of all experts."""
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    path = _with_value(tiny_checkpoint("next-moe"), tmp_path / "bad", float("nan"), name)
    assert _message(path).startswith(f"tensor {name} (float32 on disk) holds non-finite values: 1 NaN, 0 Inf "
                                     f"of {32 * 64}; ")


@pytest.mark.parametrize(
    "name,index,where",
    [
        (
            "model.layers.1.mlp.experts.gate_up_proj",
            (5, 40, 3),
            "expert 5's up_proj ([5, 32:64]; 1 expert(s) affected: 5)",
        ),
        (
            "model.layers.1.mlp.experts.gate_up_proj",
            (2, 31, 3),
            "expert 2's gate_proj ([2, 0:32]; 1 expert(s) affected: 2)",
        ),
        (
            "mtp.layers.0.mlp.experts.down_proj",
            (7, 0, 0),
            "expert 7's down_proj ([7, 0:64]; 1 expert(s) affected: 7)",
        ),
    ],
)
def test_a_fused_expert_tensor_names_the_expert_and_projection(name, index, where, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("next-moe")  # 8 experts, Ie 32, H 64
    path = _with_value(
        src, tmp_path / "bad", float("nan"), name, index, tensors=fuse_experts(read_tensors(src))
    )
    assert _message(path).startswith(f"tensor {name} (float32 on disk) holds non-finite values in {where}: "
                                     f"1 NaN, 0 Inf of {32 * 64}; ")


def test_every_affected_expert_is_counted(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("next-moe")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    tensors = fuse_experts(read_tensors(src))
    tensors[name] = tensors[name].clone()
    tensors[name][6, 1, 1] = float("inf")
    path = _with_value(src, tmp_path / "bad", float("nan"), name, (3, 0, 0), tensors=tensors)
    assert "in expert 3's gate_proj ([3, 0:32]; 2 expert(s) affected: 3, 6): 1 NaN, 0 Inf of " in _message(
        path
    )


@pytest.mark.parametrize("preset,name", [
    ("qwen35-mm", "model.language_model.layers.2.mlp.down_proj.weight"),
    ("qwen35-moe-mm", "model.language_model.layers.1.mlp.experts.5.up_proj.weight"),
])
def test_a_wrapped_checkpoint_is_named_with_its_prefix(preset, name, tiny_checkpoint, tmp_path):
    path = _with_value(tiny_checkpoint(preset), tmp_path / "bad", float("nan"), name, index=(1, 1))
    assert _message(path).startswith(f"tensor {name} (float32 on disk) holds non-finite values: 1 NaN")


def test_the_flag_loads_it_anyway(tiny_checkpoint, tmp_path):
    path = _with_value(tiny_checkpoint("next-tiny"), tmp_path / "bad", float("nan"))
    model, _ = load_model(path, allow_non_finite=True)
    assert torch.isnan(model.state_dict()[NAME]).any()
    llm = LLM(model=str(path), allow_non_finite_weights=True)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].finish_reason in ("length", "stop")


def test_values_that_overflow_the_chosen_dtype_are_refused(tiny_checkpoint, tmp_path):
    # finite in float32, inf in float16
    path = _with_value(tiny_checkpoint("next-tiny"), tmp_path / "big", -1e6)
    load_model(path)
    load_model(path, dtype=torch.bfloat16)
    message = _message(path, dtype=torch.float16)
    assert message.startswith(f"tensor {NAME} (float32 on disk) holds values beyond the range of float16: "
                              f"1 of 8192 become Inf (largest magnitude 1e+06, float16 holds up to 65504); ")
    assert "allow_non_finite_weights=True" in message
    assert (
        load_model(path, dtype=torch.float16, allow_non_finite=True)[0].state_dict()[NAME].isinf().sum() == 1
    )


def test_overflow_in_a_fused_expert_names_the_expert(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("next-moe")
    name = "model.layers.2.mlp.experts.down_proj"
    path = _with_value(src, tmp_path / "big", 7e4, name, (4, 10, 3), tensors=fuse_experts(read_tensors(src)))
    assert re.search(
        r"beyond the range of float16 in expert 4's down_proj \(\[4, 0:64\]; 1 expert\(s\) affected: "
        r"4\): 1 of 2048 become Inf",
        _message(path, dtype=torch.float16),
    )


def test_healthy_checkpoints_load(tiny_checkpoint):
    load_model(tiny_checkpoint("next-tiny"))
    load_model(tiny_checkpoint("next-tiny"), dtype=torch.float16)  # the tiny weights fit float16
