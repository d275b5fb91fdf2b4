"""Refuse degenerate weights at load: a NaN or Inf in any tensor makes every output meaningless
(a model that emits token 0 forever still "agrees" with itself), so it is an error naming the
tensor unless explicitly allowed for debugging.

The check runs on the tensors as read from the checkpoint, by the file's own names and dtypes, before
any fusing, splitting or dtype conversion: the error names what the user can find in their file. Values
that are finite on disk but overflow the dtype the model is loaded in are refused the same way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

# Routed experts fused on disk ([E, 2Ie, H] rows [gate | up], [E, H, Ie]): the projections along dim 1.
FUSED_EXPERT_RE = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
FUSED_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
MAX_LISTED_EXPERTS = 8
HOW_TO_ALLOW = ("pass allow_non_finite_weights=True (LLM) or allow_non_finite=True (load_model) "
                "to load it anyway for debugging")


class CheckpointError(ValueError):
    """The checkpoint on disk does not match what the model needs."""


def check_finite(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None,
                 allow_non_finite: bool = False) -> None:
    """Raise CheckpointError naming the first tensor (in name order) that holds NaN or Inf, or values
    that become Inf in ``dtype`` (the dtype the model is loaded in; None: no conversion).

    ``tensors`` maps the file's tensor names to the tensors as read. One min/max reduction per tensor
    (no temporary of the tensor's size), so it is cheap enough for every load; the slower counting
    only runs for the tensor being reported. ``allow_non_finite=True`` skips the check.
    """
    if allow_non_finite:
        return
    for name in sorted(tensors):
        tensor = tensors[name]
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        low, high = torch.aminmax(tensor)  # NaN and Inf reach the extremes
        extremes = torch.stack([low, high])
        if not bool(torch.isfinite(extremes).all()):
            raise CheckpointError(_non_finite_message(name, tensor))
        if dtype is not None and dtype != tensor.dtype and not bool(torch.isfinite(extremes.to(dtype)).all()):
            raise CheckpointError(_overflow_message(name, tensor, dtype))


def _non_finite_message(name: str, tensor: torch.Tensor) -> str:
    bad = ~torch.isfinite(tensor)
    where, values, mask = _locate(name, tensor, bad)
    nans = int(torch.isnan(values[mask]).sum())
    return (f"tensor {name} ({_dtype_name(tensor.dtype)} on disk) holds non-finite values{where}: "
            f"{nans} NaN, {int(mask.sum()) - nans} Inf of {values.numel()}; {HOW_TO_ALLOW}")


def _overflow_message(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> str:
    bad = torch.isinf(tensor.to(dtype))
    where, values, mask = _locate(name, tensor, bad)
    largest = float(values[mask].abs().max())
    return (f"tensor {name} ({_dtype_name(tensor.dtype)} on disk) holds values beyond the range of "
            f"{_dtype_name(dtype)}{where}: {int(mask.sum())} of {values.numel()} become Inf (largest "
            f"magnitude {largest:.6g}, {_dtype_name(dtype)} holds up to {torch.finfo(dtype).max:.6g}); "
            f"load it in a wider dtype, or {HOW_TO_ALLOW}")


def _locate(name: str, tensor: torch.Tensor, bad: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Where the ``bad`` values are, for the message: for a fused expert tensor the first affected
    expert and projection (``" in expert 5's up_proj ..."``) with that part's values and mask, so the
    counts are that expert's; for any other tensor ``""`` and the whole tensor."""
    match = FUSED_EXPERT_RE.search(name)
    if match is None or tensor.dim() != 3:
        return "", tensor, bad
    experts = bad.flatten(1).any(dim=1).nonzero().flatten().tolist()
    expert = experts[0]
    parts = FUSED_EXPERT_PARTS[match.group(1)]
    rows = tensor.shape[1] // len(parts)
    index = next(i for i in range(len(parts)) if bool(bad[expert, i * rows:(i + 1) * rows].any()))
    span = slice(index * rows, (index + 1) * rows)
    listed = ", ".join(map(str, experts[:MAX_LISTED_EXPERTS])) + (
        ", ..." if len(experts) > MAX_LISTED_EXPERTS else ""
    )
    where = (f" in expert {expert}'s {parts[index]} ([{expert}, {span.start}:{span.stop}]; "
             f"{len(experts)} expert(s) affected: {listed})")
    return where, tensor[expert, span], bad[expert, span]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
