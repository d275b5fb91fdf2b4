"""Bounds checking for Triton kernels run by the interpreter: a CPU stand-in for a GPU memory checker.

On a GPU an unmasked lane that reads or writes outside every allocation is an illegal memory access
that kills the process's CUDA context (and, under xdist, every later test of the worker). The Triton
interpreter runs the same kernel on host memory, where such a lane reads a neighbouring allocation or
nothing at all, silently. Inside ``bounds_checked()`` every masked-in address of every ``tl.load`` and
``tl.store`` of a launch must lie inside the storage of one of the launch's tensor arguments (the
allocation, as a GPU checker sees it: a view may reach the rest of its storage); the first that does not
raises ``OutOfBounds`` naming the access, the program id and the arguments' storages.

It wraps two interpreter internals (``GridExecutor._init_args_hst``, where a launch's tensor arguments
are put on the host, and the interpreter builder's masked load and store) for the ``with`` block only;
a Triton whose interpreter lacks them is refused with that said. Kernels compiled for CUDA are not
touched.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass


class OutOfBounds(AssertionError):
    """A kernel run by the interpreter loaded or stored outside every tensor argument's storage."""


@dataclass(frozen=True)
class Span:
    start: int  # the storage's first byte
    end: int  # one past its last byte
    what: str  # the argument, for the report: shape and dtype


def unavailable() -> str | None:
    """Why this Triton's interpreter cannot be bounds checked (the internals it lacks), or None."""
    import triton
    import triton.runtime.interpreter as interp

    builder = getattr(interp, "interpreter_builder", None)
    needed = (("GridExecutor._init_args_hst", getattr(interp, "GridExecutor", None), "_init_args_hst"),
              ("interpreter_builder.create_masked_load", builder, "create_masked_load"),
              ("interpreter_builder.create_masked_store", builder, "create_masked_store"),
              ("_get_np_dtype", interp, "_get_np_dtype"))
    missing = [name for name, owner, attr in needed if not hasattr(owner, attr)]
    if missing:
        return f"the bounds check needs the Triton interpreter's {', '.join(missing)}, which triton " \
               f"{triton.__version__} lacks"
    return None


def _interpreter():
    import triton.runtime.interpreter as interp

    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    return interp, interp.interpreter_builder


@contextmanager
def bounds_checked():
    """Check every interpreted launch inside the block (see the module docstring)."""
    import numpy as np

    interp, builder = _interpreter()
    spans: list[Span] = []  # the tensor arguments of the launch being run
    init_args = interp.GridExecutor._init_args_hst
    load, store = builder.create_masked_load, builder.create_masked_store

    def init_args_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        spans.clear()
        for arg in [*args_hst, *kwargs_hst.values()]:
            if hasattr(arg, "untyped_storage"):
                storage = arg.untyped_storage()
                spans.append(Span(storage.data_ptr(), storage.data_ptr() + storage.nbytes(),
                                  f"{tuple(arg.shape)} {arg.dtype}"))
        return args_hst, kwargs_hst

    def check(kind: str, ptrs, mask) -> None:
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        active = np.broadcast_to(mask.data, np.shape(ptrs.data)).astype(bool)
        addrs = np.broadcast_to(ptrs.data, active.shape)[active].astype(np.uint64)
        if addrs.size == 0:
            return
        first, last = int(addrs.min()), int(addrs.max()) + size
        if any(span.start <= first and last <= span.end for span in spans):
            return  # the common case: every lane inside one argument
        inside = np.zeros(addrs.shape, dtype=bool)
        for span in spans:
            inside |= (addrs >= span.start) & (addrs + size <= span.end)
        if not inside.all():
            bad = [hex(int(a)) for a in addrs[~inside][:3]]
            args = ", ".join(f"[{hex(s.start)}, +{s.end - s.start}) {s.what}" for s in spans)
            raise OutOfBounds(f"{kind} of {int((~inside).sum())} lane(s) outside every tensor argument, "
                              f"e.g. at {', '.join(bad)}, in program {tuple(builder.grid_idx)}; "
                              f"the arguments' storages: {args}")

    def masked_load(ptrs, mask, other, *rest):
        check("load", ptrs, mask)
        return load(ptrs, mask, other, *rest)

    def masked_store(ptrs, value, mask, *rest):
        check("store", ptrs, mask)
        return store(ptrs, value, mask, *rest)

    interp.GridExecutor._init_args_hst = init_args_checked
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    try:
        yield
    finally:
        interp.GridExecutor._init_args_hst = init_args
        builder.create_masked_load, builder.create_masked_store = load, store
