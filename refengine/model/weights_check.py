"""Refuse degenerate weights at load: a NaN or Inf in any tensor makes every output meaningless
(a model that emits token 0 forever still "agrees" with itself), so it is an error naming the
tensor unless explicitly allowed for debugging."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def check_finite(tensors: Mapping[str, torch.Tensor], allow_non_finite: bool = False) -> None:
    """Raise CheckpointError naming the first tensor (by name) holding NaN or Inf values.

    Run on the tensors as the model will hold them (after the dtype conversion), so values that
    overflow the chosen dtype are caught too. ``allow_non_finite=True`` skips the check.
    """
    if allow_non_finite:
        return
    from refengine.model.loader import CheckpointError

    for name in sorted(tensors):
        t = tensors[name]
        if not t.is_floating_point():
            continue
        finite = torch.isfinite(t)
        if bool(finite.all()):
            continue
        bad = t[~finite]
        nans = int(torch.isnan(bad).sum())
        raise CheckpointError(
            f"tensor {name} ({t.dtype}) holds non-finite values: {nans} NaN, {bad.numel() - nans} Inf "
            f"of {t.numel()}; pass allow_non_finite_weights=True (LLM) or allow_non_finite=True "
            f"(load_model) to load it anyway for debugging")
