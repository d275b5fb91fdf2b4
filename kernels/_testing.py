"""Closeness checks for kernel tests (relative RMS error with a fixed ratio, never soft)."""

from __future__ import annotations

import torch


def rel_rms_error(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref64, out64 = ref.double(), out.double()
    denom = ref64.pow(2).mean().sqrt().item()
    err = (ref64 - out64).pow(2).mean().sqrt().item()
    return err / denom if denom > 0 else err


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float, atol: float = 1e-6) -> None:
    """Pass when max |ref - out| <= atol, else require no NaN and rel-RMS error below ``ratio``."""
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    diff = (ref.double() - out.double()).abs()
    if diff.numel() == 0 or diff.max().item() <= atol:
        return
    assert not torch.isnan(out).any(), f"{name}: output has NaN"
    err = rel_rms_error(ref, out)
    assert err < ratio, (
        f"{name}: relative RMS error {err:.3e} >= {ratio:.1e} (max abs diff {diff.max().item():.3e})"
    )
