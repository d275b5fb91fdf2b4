"""Degenerate checkpoints are refused at load, naming the tensor; a flag allows them for debugging."""

from __future__ import annotations

import pytest
import torch

from refengine import LLM, SamplingParams
from refengine.model import CheckpointError, load_model
from tests.helpers.checkpoints import read_tensors, write_variant

NAME = "model.layers.1.mlp.up_proj.weight"


def _with_value(tiny_checkpoint, tmp_path, value: float, name: str = NAME):
    src = tiny_checkpoint("next-tiny")
    tensors = read_tensors(src)
    tensors[name] = tensors[name].clone()
    tensors[name][3, 5] = value
    return write_variant(src, tmp_path / "bad", tensors)


@pytest.mark.parametrize("value,kind", [(float("nan"), "1 NaN, 0 Inf"), (float("inf"), "0 NaN, 1 Inf"),
                                        (float("-inf"), "0 NaN, 1 Inf")])
def test_non_finite_weight_is_refused_by_name(value, kind, tiny_checkpoint, tmp_path):
    path = _with_value(tiny_checkpoint, tmp_path, value)
    with pytest.raises(CheckpointError, match=rf"tensor {NAME} \(torch.float32\) holds non-finite values: {kind}"):
        load_model(path)
    with pytest.raises(CheckpointError, match=f"tensor {NAME}.*allow_non_finite_weights=True"):
        LLM(model=str(path))


def test_the_flag_loads_it_anyway(tiny_checkpoint, tmp_path):
    path = _with_value(tiny_checkpoint, tmp_path, float("nan"))
    model, _ = load_model(path, allow_non_finite=True)
    assert torch.isnan(model.state_dict()[NAME]).any()
    llm = LLM(model=str(path), allow_non_finite_weights=True)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].finish_reason in ("length", "stop")


def test_values_that_overflow_the_chosen_dtype_are_refused(tiny_checkpoint, tmp_path):
    path = _with_value(tiny_checkpoint, tmp_path, 1e6)  # finite in float32, inf in float16
    load_model(path)
    with pytest.raises(CheckpointError, match=rf"tensor {NAME} \(torch.float16\) holds non-finite values"):
        load_model(path, dtype=torch.float16)


def test_healthy_checkpoints_load(tiny_checkpoint):
    load_model(tiny_checkpoint("next-tiny"))
