"""Backend selection: Triton on CUDA tensors, the torch reference on CPU tensors.

``KERNELS_BACKEND`` (environment) or ``backend=`` (argument, wins) forces a choice:
``"triton"`` runs the Triton kernel, on CPU through the Triton interpreter; ``"torch"`` runs the
reference on any device; ``"auto"`` (default) picks by device.
"""

from __future__ import annotations

import os

import torch

_VALID = ("auto", "torch", "triton")


def resolve_backend(backend: str | None, *tensors: torch.Tensor) -> str:
    """Return ``"torch"`` or ``"triton"`` for a call over ``tensors``."""
    choice = backend if backend is not None else os.environ.get("KERNELS_BACKEND", "auto")
    if choice not in _VALID:
        raise ValueError(f"kernel backend must be one of {_VALID}, got {choice!r}")
    on_cuda = False
    for t in tensors:  # a loop, not any(generator): this runs on every kernel call
        if t.is_cuda:
            on_cuda = True
            break
    if choice == "auto":
        return "triton" if on_cuda else "torch"
    if choice == "triton" and not on_cuda:
        ensure_interpreter()
    return choice


def backend_for(device: torch.device | str, backend: str | None = None) -> str:
    """The backend calls on ``device`` resolve to (``"torch"`` or ``"triton"``), without a tensor."""
    choice = backend if backend is not None else os.environ.get("KERNELS_BACKEND", "auto")
    if choice not in _VALID:
        raise ValueError(f"kernel backend must be one of {_VALID}, got {choice!r}")
    if choice == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return choice


def ensure_interpreter() -> None:
    """Make Triton kernels run on CPU tensors.

    The interpreter flag is read when a kernel is decorated, so it must be set before the Triton
    kernel modules are imported; they are imported lazily by the dispatchers, after this call.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
