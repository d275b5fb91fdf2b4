from __future__ import annotations

import importlib.util

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
