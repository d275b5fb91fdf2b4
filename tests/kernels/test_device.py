"""Where kernel tests build their tensors (tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, generator


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_triton_cases_run_on_the_device_and_reference_cases_on_the_cpu(backend, device):
    expected = torch.device("cpu") if backend == "torch" else DEVICE
    assert device == expected
    assert torch.zeros(2).device.type == expected.type
    assert torch.tensor([1, 2], dtype=torch.int32).device.type == expected.type


@pytest.mark.cpu_only
def test_cpu_only_cases_run_on_the_cpu(device):
    assert device == torch.device("cpu") and torch.randn(3).device.type == "cpu"


def test_generator_follows_the_device_and_repeats(device):
    a = torch.randn(5, generator=generator(7))
    b = torch.randn(5, generator=generator(7))
    assert a.device.type == device.type and torch.equal(a, b)
