"""Where kernel tests run, and the random generators they share.

Every kernel test runs inside ``torch.device(DEVICE)``: tensors it builds without naming a device
land on the CUDA device when there is one, so ``backend="triton"`` runs the compiled kernel there
and the torch reference it is compared with runs on the same inputs on the same device. Without
CUDA, ``DEVICE`` is the CPU and the Triton kernels run under the interpreter (tests/conftest.py).

Two kinds of test always run on the CPU, and say so:

- the torch reference's own checks (tests parametrised with ``backend="torch"``): the reference is
  the spec, the engines run it on the CPU, and its bitwise claims (row invariance, chunking
  invariance, both conv forms equal) are made there: on a GPU torch picks reduction and matmul
  kernels by shape, so the same row in a bigger batch may round differently;
- tests marked ``cpu_only``: the reference batch-invariance checks without a backend parameter and
  bitwise claims of the torch references on CPU.

The Triton kernels' bitwise claims hold on the GPU as on the CPU: each is one compiled kernel whose
programs each handle one row (or one query block) with a fixed reduction order that does not
depend on the grid, and the claims compare that kernel with itself.
"""

from __future__ import annotations

import importlib.util
from contextlib import nullcontext

import pytest
import torch

from kernels._bounds import bounds_checked
from kernels._bounds import unavailable as bounds_unavailable

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_for(request) -> torch.device:
    """The device a kernel test runs on (see the module docstring)."""
    callspec = getattr(request.node, "callspec", None)
    if request.node.get_closest_marker("cpu_only") is not None:
        return torch.device("cpu")
    if callspec is not None and callspec.params.get("backend") == "torch":
        return torch.device("cpu")
    return DEVICE


def generator(seed: int) -> torch.Generator:
    """A seeded generator on the current test's device (``torch.randn(..., generator=g)`` needs both to
    agree)."""
    return torch.Generator(device=torch.get_default_device()).manual_seed(seed)


@pytest.fixture(autouse=True)
def device(request) -> torch.device:
    """Builds every tensor of the test on its device (``torch.device`` as the default device); on the CPU,
    every Triton launch the interpreter runs is bounds checked (kernels/_bounds.py), as a GPU's memory
    checker would check the compiled kernel."""
    dev = device_for(request)
    checked = HAS_TRITON and not torch.cuda.is_available() and bounds_unavailable() is None
    with dev, (bounds_checked() if checked else nullcontext()):  # a Triton without it fails test_bounds.py
        yield dev
