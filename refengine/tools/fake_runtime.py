"""A whole engine on fake CUDA: the CUDA runtime's host side stood in for, every launch counted by name.

``FakeRuntime`` (a context manager) lets an engine built for ``device="cuda"`` run its CUDA code paths on
a CPU-only torch, with no kernel run:

- device tensors are fake (``refengine.tools.fake_cuda``): shapes, dtypes and strides, no data; the
  counting mode (``FakeRuntime.mode``) is entered around the engine's device work only, so the host's own
  tensors stay real CPU tensors (reads of them work, and cost what they cost);
- ``torch.cuda``'s streams, events, graphs, ``stream()`` and ``synchronize`` are stand-ins that run
  nothing: an event is always passed, a graph's capture runs its program once (fake) and ``replay``
  is one launch;
- ``pin_memory=True`` on host tensors is dropped (a CPU-only torch has no pinned allocator);
- every Triton launch is recorded by kernel name instead of run (no launch check: tests/fakecuda does
  that).

Every launch a GPU would see is counted by name in ``launches`` (key: the caller's ``tag()``, then the
name): an aten op that runs a kernel (``aten.<op>``; views and allocations run none), a Triton kernel
(``triton.<kernel>``), a host/device copy (``memcpy HtoD`` / ``memcpy DtoH``), a graph replay
(``cuda graph replay``); ``events`` counts event records. Launches while a graph is captured are
counted apart (``captured``): a replay runs them, not the host.

Times are the host thread's CPU time (``clock``). ``fake_seconds`` sums what the caller should take off
its host timings: the fake tensors' own Python inside the mode's handler (a FakeTensor op costs ~100-200
us), and the mode's entry for an op on host tensors only and for a metadata query, free on a GPU's
host (``calibrate`` measures the entry per kind of op). A device op's entry into the handler stays in the
host's time: it stands for issuing the op, which a GPU's host pays too (there a few microseconds, here
~20-60); ``device_entries`` sums its calibrated estimate per tag, for a figure without it. The device
ops are counted too: ``device_ops`` (views and allocations included) and ``launches``.

Not thread-safe: the stand-ins are patched onto ``torch.cuda``, ``torch`` and Triton for the block.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from typing import Self

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from refengine.tools.fake_cuda import CUDA, FakeCuda, install_cuda_guard

aten = torch.ops.aten
# ops that run no kernel on a GPU: allocations and metadata (views are told by their schema)
NO_KERNEL = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten._unsafe_view.default,
                       aten.lift_fresh.default, aten.detach.default, aten.is_pinned.default})
PINNED_FACTORIES = ("empty", "zeros", "ones", "full")
# the host thread's CPU time: what other processes run on a shared machine does not count (a syscall, ~2 us)
clock = time.thread_time
HTOD, DTOH, REPLAY = "memcpy HtoD", "memcpy DtoH", "cuda graph replay"


def _has_fake(args) -> bool:
    for a in args:
        if isinstance(a, FakeTensor):
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(x, FakeTensor) for x in a):
            return True
    return False


def _on_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class CountingMode(FakeTensorMode):
    """Fake CUDA tensors whose ops are counted as launches; ops over real host tensors only run for real
    (``pin_memory`` dropped)."""

    def __init__(self, runtime: FakeRuntime):
        super().__init__(allow_non_fake_inputs=True)  # real host tensors copied in or used as indices
        self.runtime = runtime
        self._depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._depth:  # a decomposition inside a fake op: the op was counted once
            return super().__torch_dispatch__(func, types, args, kwargs)
        start = clock()
        rt, real = self.runtime, 0.0
        self._depth += 1
        kind = "kernel"
        try:
            if not _has_fake(args) and not _has_fake(kwargs.values()) and not _on_cuda(kwargs.get("device")):
                kind = "host"  # host work: real, and timed as the host's
                if func is aten.is_pinned.default:
                    return False
                if func is aten._pin_memory.default:
                    return args[0]
                if kwargs.get("pin_memory"):
                    kwargs = {**kwargs, "pin_memory": False}
                t = clock()
                out = func(*args, **kwargs)
                real = clock() - t
                return out
            if func.namespace == "prim":  # a metadata query (``is_cuda``)
                kind = "query"
                return super().__torch_dispatch__(func, types, args, kwargs)
            tag = rt.tag()
            rt.device_ops[tag] += 1
            if func is aten.copy_.default and not isinstance(args[1], FakeTensor):
                rt.launch(HTOD)  # a host tensor into a device one: the data is not needed
                return args[0]
            if func is aten.copy_.default and not isinstance(args[0], FakeTensor):
                rt.launch(DTOH)  # into a host tensor: it keeps what the caller fills it with
                return args[0]
            if func is aten._to_copy.default and not isinstance(args[0], FakeTensor):
                rt.launch(HTOD)
                src = args[0]
                return super().__torch_dispatch__(aten.empty_strided.default, types,
                                                  (src.shape, src.stride()),
                                                  {"dtype": kwargs.get("dtype") or src.dtype, "device": CUDA})
            if func.namespace == "aten" and func not in NO_KERNEL and not func.is_view:
                rt.launch(f"aten.{func.overloadpacket.__name__}")
            else:
                kind = "view"
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._depth -= 1
            rt.ops[kind] += 1
            if kind in ("view", "kernel"):  # kept in the host's time, and noted apart (``device_entries``)
                rt.device_entries[tag] += rt.entries[kind]
                rt.fake_seconds += clock() - start - real
            else:
                rt.fake_seconds += clock() - start - real + rt.entries[kind]


class FakeEvent:
    def __init__(self, runtime: FakeRuntime):
        self.runtime = runtime

    def record(self, stream=None) -> None:
        self.runtime.events[self.runtime.tag()] += 1

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


class FakeStream:
    def __init__(self, *_, **__):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class FakeGraph:
    def __init__(self, runtime: FakeRuntime):
        self.runtime = runtime

    def replay(self) -> None:
        self.runtime.launch(REPLAY)


class FakeRuntime:
    """``with FakeRuntime() as rt:`` the stand-ins above; ``rt.mode`` around device work."""

    def __init__(self):
        self.mode = CountingMode(self)
        self.fc = FakeCuda(mode=self.mode)
        self.launches: dict[str, Counter] = defaultdict(Counter)  # tag -> launch name -> count
        self.captured: Counter = Counter()  # launch name -> count, while a graph was captured
        self.events: Counter = Counter()  # tag -> event records
        self.fake_seconds = 0.0
        self.device_ops: Counter = Counter()  # tag -> ops on device tensors (views and allocations included)
        self.ops: Counter = Counter()  # kind ("host", "query", "view", "kernel") -> ops that entered the mode
        self.device_entries: Counter = Counter()  # tag -> the calibrated entries of its device ops, seconds
        self.entries = dict.fromkeys(("host", "query", "view", "kernel"), 0.0)  # kind -> ``calibrate``'s
        self.tag: Callable[[], str] = lambda: ""
        self._capturing = 0
        self._stack: ExitStack | None = None

    def clear(self) -> None:
        """Forget what was counted and timed so far (the calibration stays)."""
        self.launches.clear(), self.captured.clear(), self.events.clear(), self.device_ops.clear()
        self.ops.clear(), self.device_entries.clear()
        self.fake_seconds = 0.0

    def in_mode(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` with the counting mode entered (its entry and exit timed as fake)."""
        start = clock()
        self.mode.__enter__()
        self.fake_seconds += clock() - start
        try:
            return fn(*args, **kwargs)
        finally:
            start = clock()
            self.mode.__exit__(None, None, None)
            self.fake_seconds += clock() - start

    def launch(self, name: str) -> None:
        if self._capturing:
            self.captured[name] += 1
        else:
            self.launches[self.tag()][name] += 1

    def __enter__(self) -> Self:
        install_cuda_guard()
        self._stack = stack = ExitStack()
        stack.enter_context(self._patched_cuda())
        stack.enter_context(self._patched_factories())
        stack.enter_context(self._patched_triton())
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def calibrate(self, rounds: int = 300) -> dict[str, float]:
        """Measure what entering the mode costs (the time from an op's call to the mode's handler and back,
        outside the handler's own timing), per kind of op: an op on host tensors only, a metadata query, a
        view or allocation of a device tensor, a device op that runs a kernel (medians over a few of each),
        and take it off every later host op and query (a device op's is noted in ``device_entries``).
        Returns kind -> seconds."""
        self.entries = dict.fromkeys(self.entries, 0.0)
        h = torch.zeros(16, 8, dtype=torch.int64)
        with self.mode:
            x = torch.zeros(16, 8, device=CUDA)
            i = torch.zeros(4, dtype=torch.int64, device=CUDA)
            ops = {"host": (lambda: h[:4], lambda: h[:, 1], lambda: h + h),
                   "query": (lambda: x.is_cuda,),
                   "view": (lambda: x[:4], lambda: x.view(-1), lambda: x[:, None],
                            lambda: x.view(torch.int32), lambda: torch.empty(8, device=CUDA)),
                   "kernel": (lambda: x + x, lambda: x[i], lambda: i.to(torch.int32), lambda: x.cumsum(0),
                              lambda: torch.where(x > 0, x, x), lambda: torch.cat([x, x]))}
            measured = {kind: statistics.median(self._residual(op, rounds, kind) for op in fns)
                        for kind, fns in ops.items()}
        self.clear()
        self.entries = measured
        return measured

    def _residual(self, op, rounds: int, kind: str) -> float:
        """Seconds per op of ``kind`` that ``op`` spends outside the handler's timing."""
        op()
        fake, n = self.fake_seconds, self.ops[kind]
        start = clock()
        for _ in range(rounds):
            op()
        wall = clock() - start
        return (wall - (self.fake_seconds - fake)) / max(self.ops[kind] - n, 1)

    def module(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` with fake CUDA parameters and buffers."""
        return self.fc.module(model)

    @contextmanager
    def _patched_cuda(self):
        rt, current = self, FakeStream()

        @contextmanager
        def stream(_):
            yield

        @contextmanager
        def graph(_graph, *args, **kwargs):
            rt._capturing += 1
            try:
                yield
            finally:
                rt._capturing -= 1

        names = {"Stream": FakeStream, "Event": lambda *a, **k: FakeEvent(rt), "stream": stream,
                 "current_stream": lambda *a: current, "CUDAGraph": lambda: FakeGraph(rt), "graph": graph,
                 "graph_pool_handle": lambda: None,
                 "synchronize": lambda *a: None, "_sleep": lambda cycles: None}
        with _patched(torch.cuda, names):
            yield

    @contextmanager
    def _patched_factories(self):
        def unpinned(factory):
            def call(*args, pin_memory=False, **kwargs):
                return factory(*args, **kwargs)
            return call

        with _patched(torch, {name: unpinned(getattr(torch, name)) for name in PINNED_FACTORIES}):
            yield

    @contextmanager
    def _patched_triton(self):
        from kernels._launch_check import _kernel_classes

        rt = self

        def run(fn_self, *args, grid, warmup, **kwargs):
            start = clock()
            rt.launch(f"triton.{getattr(fn_self, 'fn', fn_self).__name__}")
            rt.fake_seconds += clock() - start

        with _patched_classes(_kernel_classes(), "run", run):
            yield


@contextmanager
def _patched(owner, values: dict):
    old = {name: getattr(owner, name) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(owner, name, value)


@contextmanager
def _patched_classes(classes, name: str, value):
    old = [(cls, cls.__dict__[name]) for cls in classes]
    for cls in classes:
        setattr(cls, name, value)
    try:
        yield
    finally:
        for cls, original in old:
            setattr(cls, name, original)
