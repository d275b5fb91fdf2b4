"""Fake CUDA on a CPU-only build: tensors with ``device="cuda"`` that have shapes, dtypes and strides but
no data (``torch._subclasses.fake_tensor.FakeTensorMode``), and the checks a GPU would make of code
that runs on them.

Inside ``FakeCuda`` (a context manager):

- any host read of a fake tensor (``.item()``, ``.tolist()``, ``bool(t)``, an op whose output shape
  depends on values) raises ``DataDependentOutputException`` (and a real, non-fake tensor reaching an
  op raises too: ``allow_non_fake_inputs=False``);
- mixing devices in one op raises ``FakeTensorDeviceMismatchError``;
- ``with fc.watching() as watch:`` records every op run in the block: ``watch.cpu_ops`` lists those that
  produced a CPU tensor (a tensor built without ``device=``, a ``.cpu()``); ``watch.ops`` has the
  storages each op read, allocated and wrote (for the CUDA-graph check, tests/fakecuda/test_graph_capture.py);
- every Triton launch is checked against ``kernels._launch_check.SPECS`` and recorded in
  ``launches.launches`` instead of run.

The tests (tests/fakecuda/) check the engines' device code with it; ``refengine bench --fake-cuda``
(``refengine.tools.host_bench``) runs a whole engine on it to measure the host's cost per step.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import subprocess
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kernels._launch_check import LaunchRecorder

CUDA = torch.device("cuda", 0)
_REGISTRY = "_ZN3c104impl26device_guard_impl_registryE"  # c10::impl::device_guard_impl_registry
_GUARD_SOURCE = """#include <c10/core/impl/DeviceGuardImplInterface.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
"""


class NoCudaGuard(RuntimeError):
    """A CPU-only torch without a way to give it a CUDA device guard (no C++ compiler, or it failed)."""


def install_cuda_guard() -> None:
    """Give a CPU-only torch a no-op CUDA device guard, once per process.

    torch's Python bindings of some methods (``copy_``, ``contiguous``, indexing, ``.to("cuda")``) open a
    device guard for their tensor's device before any dispatch, and a CPU-only build has none for CUDA,
    so they raise "PyTorch is not linked with support for cuda devices" even on fake tensors. The guard
    installed here (c10's ``NoOpDeviceGuardImpl`` for CUDA, in a 3-line library built with the system C++
    compiler against torch's own headers, cached per torch version) switches no device and runs nothing;
    a torch with CUDA keeps its own (on a GPU machine fake CUDA tensors need nothing more; a CUDA build
    on a machine without a GPU cannot run these checks). Linux: it reads libc10.so's registry.
    """
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    c10 = ctypes.CDLL(os.path.join(lib_dir, "libc10.so"))
    registry = (ctypes.c_void_p * 2).in_dll(c10, _REGISTRY)
    if registry[1]:  # index 1: DeviceType::CUDA
        return
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise NoCudaGuard("fake CUDA on a CPU-only torch needs a C++ compiler (c++ or g++) on PATH")
    cache = os.path.join(tempfile.gettempdir(), f"fake-cuda-guard-{os.getuid()}-{torch.__version__}")
    os.makedirs(cache, exist_ok=True)
    target = os.path.join(cache, "guard.so")
    if not os.path.exists(target):
        with tempfile.TemporaryDirectory(dir=cache) as work:
            source = os.path.join(work, "guard.cpp")
            with open(source, "w") as f:
                f.write(_GUARD_SOURCE)
            built = os.path.join(work, "guard.so")
            include = os.path.join(os.path.dirname(torch.__file__), "include")
            done = subprocess.run([compiler, "-shared", "-fPIC", "-std=c++17", f"-I{include}", source,
                                   f"-L{lib_dir}", "-lc10", f"-Wl,-rpath,{lib_dir}", "-o", built],
                                  check=False, capture_output=True, text=True)
            if done.returncode:
                raise NoCudaGuard(f"building the fake CUDA device guard with {compiler} failed:\n"
                                  f"{done.stderr}")
            os.replace(built, target)  # atomic: concurrent workers load one complete file
    ctypes.CDLL(target)
    assert registry[1], "the CUDA device guard did not register"


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (views share it): its StorageImpl's address, stable while it lives."""
    return t.untyped_storage()._cdata


@dataclass
class OpRecord:
    op: str
    devices: list[str]
    allocated: list[int]  # storages the op's outputs have that no input had
    written: list[int]  # storages of the arguments the op mutates
    read: list[int]  # storages of every tensor argument
    shapes: list[tuple]  # (dtype, shape) of every output


_SCALAR_WRAPPERS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.scalar_tensor.default)


class DeviceWatch(TorchDispatchMode):
    """Records the device of every op's outputs, and which storages each op allocates and writes."""

    def __init__(self):
        super().__init__()
        self.ops: list[OpRecord] = []
        self._alive: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        seen = {storage_key(t) for t in inputs}
        allocated = [storage_key(t) for t in outputs if storage_key(t) not in seen]
        written = []
        schema = func._schema
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                value = kwargs[a.name] if a.name in kwargs else args[i] if i < len(args) else None
                written += [storage_key(t) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        # A Python number wrapped as a 0-dim CPU tensor (``x[i] = 1``, ``torch.where(m, x, 0)``) is a scalar
        # argument torch lets CUDA ops take; any other tensor on the CPU is host memory.
        scalar = func in _SCALAR_WRAPPERS and all(t.dim() == 0 for t in outputs)
        devices = ["cuda (scalar)" if scalar else str(t.device) for t in outputs]
        self.ops.append(OpRecord(str(func), devices, allocated, written, sorted(seen),
                                 [(t.dtype, tuple(t.shape)) for t in outputs]))
        self._alive += outputs  # keeps every storage alive while recorded, so no key is reused
        return out

    @property
    def cpu_ops(self) -> list[str]:
        return [f"{r.op} -> {r.devices}" for r in self.ops
                if any(not d.startswith("cuda") for d in r.devices)]

    def clear(self) -> None:
        self.ops.clear()
        self._alive.clear()


@dataclass
class FakeCuda:
    """``with FakeCuda() as fc:`` fake CUDA tensors, the device watch and the launch recorder."""

    mode: FakeTensorMode = field(default_factory=lambda: FakeTensorMode(allow_non_fake_inputs=False))
    launches: LaunchRecorder = field(default_factory=LaunchRecorder)
    _stack: ExitStack | None = None

    def __enter__(self):
        install_cuda_guard()
        self._stack = ExitStack()
        self._stack.enter_context(self.mode)
        self._stack.enter_context(self.launches.active())
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @contextmanager
    def watching(self, watch: DeviceWatch | None = None):
        """Record ops (devices, allocations, writes) inside the block only, in ``watch`` (a fresh one by
        default)."""
        watch = DeviceWatch() if watch is None else watch
        with watch:
            yield watch

    def like(self, x, memo: dict | None = None):
        """``x`` with every CPU tensor in it (nested in tuples, lists, dicts, dataclasses) replaced by a fake
        CUDA tensor of the same shape, dtype and strides; views of one base stay views of one fake base."""
        memo = {} if memo is None else memo
        if isinstance(x, torch.Tensor):
            return self._tensor(x, memo)
        if isinstance(x, dict):
            return {k: self.like(v, memo) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(self.like(v, memo) for v in x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return dataclasses.replace(x, **{f.name: self.like(getattr(x, f.name), memo)
                                             for f in dataclasses.fields(x) if f.init})
        return x

    def host(self, x, memo: dict | None = None):
        """``x`` with every real CPU tensor in it replaced by a fake CPU tensor (host staging buffers)."""
        memo = {} if memo is None else memo
        if isinstance(x, torch.Tensor):
            if id(x) not in memo:
                memo[id(x)] = self.mode.from_tensor(x)
            return memo[id(x)]
        if isinstance(x, dict):
            return {k: self.host(v, memo) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(self.host(v, memo) for v in x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return dataclasses.replace(x, **{f.name: self.host(getattr(x, f.name), memo)
                                             for f in dataclasses.fields(x) if f.init})
        return x

    def _tensor(self, t: torch.Tensor, memo: dict) -> torch.Tensor:
        if id(t) in memo:
            return memo[id(t)]
        if t.device.type == "meta" or t.is_cuda:
            return t
        base = t._base
        with self.mode:
            if base is not None:
                fake = self._tensor(base, memo).as_strided(t.shape, t.stride(), t.storage_offset())
            else:
                fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=CUDA)
        if isinstance(t, torch.nn.Parameter):
            fake = torch.nn.Parameter(fake, requires_grad=False)
        memo[id(t)] = fake
        return fake

    def module(self, model: torch.nn.Module) -> torch.nn.Module:
        """A copy of ``model`` whose parameters and buffers are fake CUDA tensors (tied ones stay tied)."""
        import copy

        memo: dict = {}
        fakes = {id(t): self._tensor(t, memo) for t in list(model.parameters()) + list(model.buffers())}
        deep_memo = dict(fakes)
        return copy.deepcopy(model, deep_memo)
