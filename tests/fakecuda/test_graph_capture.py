"""What CUDA-graph capture requires of the FULL step program, checked on fake CUDA without a GPU.

A captured graph replays the kernels it recorded on the addresses it recorded. Memory the program
allocates while it is captured comes from the graph's private pool and gets the same addresses on every
replay, so temporaries and the outputs the capture returned are fine; everything else the replay reads or
writes is whatever sat at a captured address. Hence the rule checked here, for two runs of the program
at one padded request count (the FULL graph's key):

1. every storage an op or a Triton launch of the program reads or writes is either a *static buffer*
   (one that existed before the first run: the graph's padded row table, the persistent request state,
   the KV caches and recurrent state pools, the drafter's tables, the weights) or one allocated earlier
   in the same run (the private pool). A storage allocated by an earlier run and kept (a lazily created
   scratch buffer), or one the host allocated between runs (a state tensor rebound to a new tensor),
   breaks it: the replay would use the captured address;
2. both runs issue the same ops with the same output shapes and dtypes, and the same launches with the
   same grids: the Python code runs once, at capture, so a second step of the same padded size must not
   take another path;
3. every write that outlives the step lands in a static buffer: the state the next step reads
   (``num_computed``, ``token_ids``, drafts, KV and recurrent pools) is among the storages written.

The runs use the twin of ``tests/helpers/fake_engines.py`` (``runner.program`` on fake CUDA tensors,
every launch recorded).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from refengine.async_engine.inputs import StepRows
from refengine.config import GraphMode
from tests.helpers.fake_cuda import FakeCuda, storage_key
from tests.helpers.fake_engines import SETTINGS, WAVES, AsyncTwin, record_async


def reachable_tensors(root) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through attributes, containers and dataclasses."""
    found, seen, todo = [], set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, int, float, bool, type, torch.device)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            todo += list(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            todo += list(obj)
        elif dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
            module = type(obj).__module__
            if module.split(".")[0] in ("refengine", "kernels", "tests", "torch"):
                todo += list(vars(obj).values()) if hasattr(obj, "__dict__") else []
                todo += [getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)]
    return found


@dataclasses.dataclass
class Run:
    ops: list  # (op, output dtypes and shapes)
    launches: list  # (kernel, grid)
    stray: list[str]  # what touched a storage neither static nor allocated in this run
    written: set[int]
    cpu_ops: list[str]  # ops that made a CPU tensor (a capture cannot hold host memory)


def run_program(fc: FakeCuda, twin: AsyncTwin, snap, table: torch.Tensor, static: set[int]) -> Run:
    """One run of the step program on the static ``table`` [Np, F], checked against rule 1."""
    before = len(fc.launches.launches)
    with fc.watching() as watch:
        twin.runner.program(snap.shape, StepRows.view(table))
    allocated, stray, written = set(), [], set()
    for i, op in enumerate(watch.ops):
        for key in set(op.read) | set(op.written):
            if key not in static and key not in allocated:
                stray.append(f"op {i} {op.op}")
        allocated |= set(op.allocated)
        written |= set(op.written)
    launches = fc.launches.launches[before:]
    for launch in launches:
        for name, value in launch.args.items():
            if isinstance(value, torch.Tensor):
                key = storage_key(value)
                if key not in static and key not in allocated:
                    stray.append(f"launch {launch.kernel} argument {name}")
                written.add(key)  # a kernel may write any pointer it is given
    ops = [(op.op, op.shapes) for op in watch.ops]
    return Run(ops, [(x.kernel, x.grid) for x in launches], stray, written, watch.cpu_ops)


def record_full(k: int, drafter: str):
    return record_async(WAVES[:2], max_tokens=10, graph_mode="full", num_speculative_tokens=k,
                        drafter=drafter, **SETTINGS)


def two_full_runs(run, before=None, between=None, where=None) -> tuple[Run, Run, AsyncTwin]:
    """Two runs of the FULL program at one padded size of a recorded ``run`` (two of its steps, or one
    twice); ``before`` and ``between`` (planted bugs) are called with the twin before the first run and
    between the runs; ``where``: which FULL steps may be taken (all by default)."""
    full = [s for s in run.snaps if s.shape.mode is GraphMode.FULL and (where is None or where(s))]
    assert full, "the workload ran no FULL step"
    same = [s for s in full if s.shape.graph_key == full[-1].shape.graph_key]  # one captured program
    first, second = same[-2:] if len(same) > 1 else (same[-1], same[-1])
    fc = FakeCuda()
    twin = AsyncTwin(fc, run.llm.engine)
    with fc:
        twin.stage(first)
        table = twin.table(first)  # the graph's static row table for this padded size
        static = {storage_key(t) for t in reachable_tensors(twin.runner)}
        assert storage_key(table) in static and storage_key(twin.runner.state.num_computed) in static
        if before is not None:
            before(twin)
        one = run_program(fc, twin, first, table, static)
        if between is not None:
            between(twin)
        twin.stage(second)
        assert twin.table(second) is table, "one padded size, one static table"
        two = run_program(fc, twin, second, table, static)
    return one, two, twin


@pytest.mark.parametrize("k,drafter", [(3, "mtp"), pytest.param(0, "mtp", marks=pytest.mark.slow),
                                       pytest.param(3, "ngram", marks=pytest.mark.slow)])
def test_the_full_program_touches_only_static_buffers_and_repeats_itself(k, drafter, request):
    run = request.getfixturevalue("default_run") if (k, drafter) == (3, "mtp") else record_full(k, drafter)
    one, two, twin = two_full_runs(run)
    assert not one.stray and not two.stray, (one.stray + two.stray)[:5]
    assert not one.cpu_ops and not two.cpu_ops, one.cpu_ops + two.cpu_ops
    assert one.ops == two.ops, "two steps of one padded size ran different ops: one graph cannot replay both"
    assert one.launches == two.launches
    st = twin.runner.state
    persistent = [st.num_computed, st.num_tokens, st.num_valid, st.last_sampled, st.token_ids]
    if k:
        persistent += [st.draft_tokens, st.num_drafts]
    persistent += [t for kv in twin.runner.caches.kv.values() for t in kv]
    # the recurrent state pools: the model's slots, and (prefix caching) the checkpoint copies
    persistent += [t for states in twin.runner.caches.states.values() for t in states]
    missing = [i for i, t in enumerate(persistent) if storage_key(t) not in one.written]
    assert not missing, f"persistent state the step must advance was not written: {missing}"


def test_the_full_sampling_program_touches_only_static_buffers_and_repeats_itself(default_run):
    """Seeded rejection sampling in a FULL step: the noise comes from the slots' seeds and the positions
    on the device, so two steps of one padded size run the same ops on static buffers, no host read."""
    one, two, _ = two_full_runs(default_run, where=lambda s: s.shape.sampling)
    assert not one.stray and not two.stray, (one.stray + two.stray)[:5]
    assert not one.cpu_ops and not two.cpu_ops, one.cpu_ops + two.cpu_ops
    assert one.ops == two.ops and one.launches == two.launches


def test_a_scratch_buffer_kept_across_runs_is_caught(default_run):
    """A planted bug: the verifier keeps a lazily allocated scratch buffer on the runner and writes it
    every step; the first run allocates it (fine: the private pool), the second writes an address that
    only the first run's allocation owned."""

    def keep_scratch(twin):
        runner = twin.runner
        verify = runner.verify

        def verify_into_scratch(shape, rows, step, hidden):
            out = verify(shape, rows, step, hidden)
            if not hasattr(runner, "_scratch"):
                runner._scratch = torch.empty_like(out.num_valid)
            runner._scratch.copy_(out.num_valid)
            return out

        runner.verify = verify_into_scratch

    one, two, _ = two_full_runs(default_run, before=keep_scratch)
    assert not one.stray
    assert any("copy_" in s for s in two.stray), two.stray


def test_a_state_tensor_rebound_between_runs_is_caught(default_run):
    """A planted bug: the host replaces a persistent state tensor between two steps (a new allocation
    between two replays); the graph captured on the old one would never see it."""

    def rebind(twin):
        st = twin.runner.state
        st.num_valid = st.num_valid.clone()

    one, two, _ = two_full_runs(default_run, between=rebind)
    assert not one.stray and two.stray, "reading a tensor allocated between two replays must fail the check"
