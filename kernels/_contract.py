"""Input contracts: one check per op, shared by the torch reference and the Triton wrapper.

Each op folder has a ``contract.py`` whose ``check_*_inputs`` function both implementations call
first, so the two backends accept and refuse exactly the same inputs, with the same
:class:`KernelInputError` (op, argument, what was expected, what was given). A check reads shapes,
dtypes, devices and plain arguments only, never a tensor's values: that would need a host sync on
the GPU. Value conditions (non-decreasing ``cu_seqlens``, slots inside the pool) stay the caller's
duty, as kernels/README.md says.

Inputs a Triton kernel cannot take as given (an int64 index tensor, a non-unit stride on the last
dimension, a state pool laid out differently) are converted by the wrappers with the helpers at the
end of this module, and only when the input is not already in the kernel's form: the engines' calls
pay nothing.
"""

from __future__ import annotations

import functools
from typing import NoReturn

import torch

# The floating dtypes the kernels compute from (float32 arithmetic inside); float64 is refused.
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Index and count tensors: either width; the Triton wrappers narrow or widen to the kernel's.
INDEX = (torch.int32, torch.int64)
BOOL = (torch.bool,)


class KernelInputError(ValueError):
    """An input every backend of a kernel op refuses, naming the op, the argument, what was expected
    and what was given."""

    def __init__(self, op: str, arg: str, expected: str, given: str):
        super().__init__(f"{op}: {arg} must be {expected}, got {given}")
        self.op, self.arg, self.expected, self.given = op, arg, expected, given

    def __reduce__(self):
        return type(self), (self.op, self.arg, self.expected, self.given)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe(x) -> str:
    """How a given value reads in an error: a tensor by dtype, shape and device, anything else by repr."""
    if isinstance(x, torch.Tensor):
        return f"{dtype_name(x.dtype)} tensor of shape {list(x.shape)} on {x.device}"
    return repr(x)


def _dtypes_text(dtypes: tuple[torch.dtype, ...]) -> str:
    names = [dtype_name(d) for d in dtypes]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _kind(dtypes: tuple[torch.dtype, ...]) -> str:
    """"a float32 tensor", "an int32 or int64 tensor": formatted only for an error."""
    kind = _dtypes_text(dtypes)
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} tensor"


@functools.cache
def _dim_names(shape: str) -> tuple[str, ...]:
    """``"T, Hv"`` -> ``("T", "Hv")``."""
    return tuple(shape.split(", "))


class Contract:
    """The checks of one call of one op. Every failure raises :class:`KernelInputError` naming ``op``.

    Shapes are written as dimension names (``"T, Hv"``). The first tensor that names a dimension
    binds its size; later tensors naming it must match, so an error can say ``[T, Hv] = [7, 2]``.
    """

    def __init__(self, op: str):
        self.op = op
        self.sizes: dict[str, int] = {}
        self.device: torch.device | None = None

    def refuse(self, arg: str, expected: str, given: str) -> NoReturn:
        """Raise; ``given`` is the text after "got" (``describe(value)`` for a value)."""
        raise KernelInputError(self.op, arg, expected, given)

    def require(self, ok: bool, arg: str, expected: str, given: str) -> None:
        if not ok:
            self.refuse(arg, expected, given)

    def tensor(self, arg: str, x, dtypes: tuple[torch.dtype, ...], *shapes: str, optional: bool = False):
        """``x`` must be a tensor of one of ``dtypes`` with one of ``shapes``, on the op's device."""
        if x is None and optional:
            return None
        if not isinstance(x, torch.Tensor) or x.dtype not in dtypes:
            either = "None or " if optional else ""
            self.refuse(arg, f"{either}{_kind(dtypes)} of shape {self._shapes_text(shapes)}", describe(x))
        # Plain loops, not generators: every kernel call runs this for each of its tensors.
        sizes, dims = self.sizes, x.shape
        for shape in shapes:
            names = _dim_names(shape)
            if len(names) != len(dims):
                continue
            for n, s in zip(names, dims):
                bound = sizes.get(n)
                if bound is not None and bound != s:
                    break
            else:
                for n, s in zip(names, dims):
                    sizes.setdefault(n, s)
                break
        else:
            self.refuse(arg, f"{_kind(dtypes)} of shape {self._shapes_text(shapes)}", describe(x))
        device = x.device
        if self.device is None:
            self.device = device
        elif device != self.device:
            self.refuse(arg, f"on the device of the other inputs ({self.device})", describe(x))
        return x

    def _shapes_text(self, shapes: tuple[str, ...]) -> str:
        texts = []
        for shape in shapes:
            names = shape.split(", ")
            text = f"[{shape}]"
            if any(n in self.sizes for n in names):
                text += " = [" + ", ".join(str(self.sizes.get(n, "*")) for n in names) + "]"
            texts.append(text)
        return " or ".join(texts)

    def offsets(self, arg: str, x) -> None:
        """``x``: row offsets ``[N+1]``, an int32 or int64 tensor; binds N, or checks the N bound before."""
        if "N" in self.sizes:
            self.bind("N+1", self.sizes["N"] + 1)
        self.tensor(arg, x, INDEX, "N+1")
        self.at_least(arg, "N+1", 1)
        self.bind("N", self.sizes["N+1"] - 1)

    def bind(self, dim: str, size: int) -> None:
        """Bind ``dim`` to ``size`` (a size derived from another, e.g. N from N+1)."""
        self.sizes[dim] = size

    def at_least(self, arg: str, dim: str, minimum: int) -> None:
        """The bound dimension ``dim`` of ``arg`` must be at least ``minimum``."""
        size = self.sizes[dim]
        if size < minimum:
            self.refuse(arg, f"a tensor with {dim} >= {minimum}", f"{dim} = {size}")

    def multiple(self, arg: str, dim: str, of: str) -> None:
        """Bound dimension ``dim`` must be a multiple of bound dimension ``of`` (value heads of key heads)."""
        size, base = self.sizes[dim], self.sizes[of]
        self.require(base > 0 and size % base == 0, arg,
                     f"a tensor whose {dim} is a multiple of {of} = {base}", f"{dim} = {size}")

    def integer(self, arg: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
        """A plain int (not a bool) inside ``[minimum, maximum]``."""
        ok = isinstance(value, int) and not isinstance(value, bool)
        ok = ok and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
        if not ok:
            bounds = "" if minimum is None and maximum is None else (
                f" >= {minimum}" if maximum is None else f" from {minimum} to {maximum}")
            self.refuse(arg, f"an int{bounds}", describe(value))
        return value

    def number(self, arg: str, value, optional: bool = False):
        """A plain real number (int or float, not a bool or a tensor); None too when ``optional``."""
        if value is None and optional:
            return None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            self.refuse(arg, f"{'None or ' if optional else ''}a float", describe(value))
        return value

    def flag(self, arg: str, value) -> bool:
        if not isinstance(value, bool):
            self.refuse(arg, "True or False", describe(value))
        return value

    def choice(self, arg: str, value, allowed: tuple) -> None:
        """``value`` must be one of ``allowed``, of the same type too (16.0 or True is not 16 or 1)."""
        ok = any(type(value) is type(a) and value == a for a in allowed)
        if not ok:
            self.refuse(arg, f"one of {allowed}", describe(value))


# ---------------------------------------------------------------- conversions for the Triton wrappers


def unit_stride(x: torch.Tensor, dim: int = -1) -> bool:
    """Whether ``x`` steps by one element along ``dim`` (a dimension of size <= 1 always does)."""
    return x.shape[dim] <= 1 or x.stride(dim) == 1


def with_unit_stride(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x`` itself when it steps by one element along ``dim``, else a contiguous copy."""
    return x if unit_stride(x, dim) else x.contiguous()


def as_contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` itself when contiguous (or None), else a contiguous copy."""
    return x if x is None or x.is_contiguous() else x.contiguous()


def as_index(x: torch.Tensor | None, dtype: torch.dtype = torch.int32) -> torch.Tensor | None:
    """An index / count tensor in the kernel's ``dtype`` with a unit stride on its last dimension (the
    kernels take the row stride of a 2-D one); ``x`` itself when it already is, else a contiguous copy.

    Index values (token offsets, pool slots, counts) fit int32 whatever their tensor's dtype.
    """
    if x is None or (x.dtype == dtype and unit_stride(x)):
        return x
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)  # one copy, row-major


def write_back(x: torch.Tensor, work: torch.Tensor) -> None:
    """Copy the kernel's in-place result ``work`` into ``x`` when the kernel ran on a converted copy."""
    if work is not x:
        x.copy_(work)
