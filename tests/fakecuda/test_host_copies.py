"""Copies of a step's results back to the host land in pinned memory, checked on fake CUDA.

On a GPU a device-to-host copy into pageable memory returns only once it is done, that is once the
stream has finished the step: the host thread that issues it waits for every step, and the engine runs
synchronously (a pending host buffer is then never seen either: the delay-mode hazard test on a GPU did
not raise). Into pinned memory the copy is queued like any other work. Here every recorded step's
results are copied back as ``AsyncRunner._outputs`` copies them, into ``AsyncRunner.new_future``'s host
tensors, and every copy from a CUDA tensor to the host must write a storage that was allocated pinned
(a ``.cpu()`` allocates pageable memory and fails too).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.helpers.fake_cuda import FakeCuda, storage_key
from tests.helpers.fake_engines import AsyncTwin

aten = torch.ops.aten


class HostCopies(TorchDispatchMode):
    """Records which storages were allocated pinned, and every device-to-host copy into another one."""

    def __init__(self):
        super().__init__()
        self.pinned: set[int] = set()
        self.pageable: list[str] = []  # device-to-host copies into memory not allocated pinned
        self.copies = 0  # device-to-host copies seen
        self._alive: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self._alive += outputs  # no storage key is reused while recorded
        if kwargs.get("pin_memory"):
            self.pinned |= {storage_key(t) for t in outputs}
        if func is aten.copy_.default and args[0].device.type == "cpu" and args[1].is_cuda:
            self.copies += 1
            if storage_key(args[0]) not in self.pinned:
                self.pageable.append(f"copy_ into {tuple(args[0].shape)} {args[0].dtype}")
        elif func is aten._to_copy.default and args[0].is_cuda and outputs[0].device.type == "cpu":
            self.copies += 1
            self.pageable.append(f"{func} of {tuple(args[0].shape)} {args[0].dtype} (a .cpu())")
        return out


def kinds(snaps) -> list:
    """One recorded step of each kind of what it copies back: logprobs, prompt logprobs, a grammar step
    (its drafts too), FULL or not; every step carries the observer's payload and the debug copies."""
    picked = {}
    for s in snaps:
        picked.setdefault((s.logprobs, bool(s.prompt_logprobs), s.shape.grammar, s.shape.mode), s)
    return list(picked.values())


def copy_back(snaps, engine) -> HostCopies:
    """``snaps`` run on a fake CUDA twin of ``engine`` and their results copied back."""
    fc = FakeCuda()
    twin = AsyncTwin(fc, engine)
    runner = twin.runner
    watch = HostCopies()
    for snap in snaps:
        out = twin.step(snap)
        with fc, watch:
            fut = runner.new_future(snap)
            runner._outputs(snap, twin.table(snap), fut, out)
    return watch


def test_every_copy_of_a_steps_results_to_the_host_lands_in_pinned_memory(default_run):
    assert default_run.llm.engine.stream.hazard_check, "the debug copies are part of what is checked"
    snaps = kinds(default_run.snaps)
    assert all(s.record for s in snaps) and {s.logprobs for s in snaps} == {True, False}
    assert {s.shape.grammar for s in snaps} == {True, False}
    watch = copy_back(snaps, default_run.llm.engine)
    assert watch.copies >= 3 * len(snaps)
    assert not watch.pageable, watch.pageable[:5]


def test_a_copy_into_pageable_memory_is_caught(default_run, monkeypatch):
    """A planted bug: the payload and the debug copies read back with ``.cpu()``, as before."""
    from refengine.async_engine import runner as runner_module

    monkeypatch.setattr(runner_module, "to_host", lambda t: t.cpu())
    watch = copy_back(kinds(default_run.snaps)[:1], default_run.llm.engine)
    assert any("a .cpu()" in p for p in watch.pageable), watch.pageable[:5]
