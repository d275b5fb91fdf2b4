"""``refengine bench --fake-cuda`` (refengine/tools/host_bench.py): the async engine's host cost per step on
fake CUDA, and what a FULL step launches.

A FULL step is one graph replay plus what cannot be captured: the copy of its row table in and the copy
of its results back. Every other launch a FULL step makes is host work a GPU waits behind, so the launch
list is held to those few, by name (the timings are figures, never asserted).
"""

from __future__ import annotations

import pytest

from refengine import SamplingParams
from refengine.tools import host_bench
from refengine.tools.fake_runtime import DTOH, HTOD, REPLAY

# What a FULL step may launch, at most once each per step: the row table's copy in, the replay, the results'
# copy back (a step that grows a request's blocks writes them inside the graph, from its row table).
FULL_STEP_LAUNCHES = {HTOD: 1.0, REPLAY: 1.0, DTOH: 1.0}
PROMPTS = [[(5 * j) % 250 for j in range(12)], [(7 * j + 3) % 250 for j in range(9)]]


def small_bench() -> host_bench.HostBench:
    """Two requests of 10 tokens with K=3 drafts, FULL graphs: a prefill step, then FULL decode steps
    (blocks of 4 tokens, so decode rows grow their blocks every step or two). A rough calibration: the
    launches are what is checked."""
    return host_bench.run(k=3, graph_mode="full", repeat=1, prompts=PROMPTS,
                          params=SamplingParams(max_tokens=10, ignore_eos=True), block_size=4,
                          calibration_rounds=30)


def full_step_problems(b: host_bench.HostBench) -> list[str]:
    """What a FULL step launches beyond ``FULL_STEP_LAUNCHES``, by name."""
    launched = b.launches_per_step("full")
    problems = [f"{name}: {n:.2f} per FULL step" for name, n in launched.items()
                if n > FULL_STEP_LAUNCHES.get(name, 0.0) + 1e-9]
    if launched.get(REPLAY) != 1.0:
        problems.append(f"{REPLAY}: {launched.get(REPLAY, 0.0):.2f} per FULL step, not 1")
    return problems


def test_a_full_step_launches_the_replay_and_its_copies_only():
    b = small_bench()
    steps = b.steps()
    assert steps.get("full", 0) >= 4 and steps.get("none", 0) >= 1, steps
    assert not full_step_problems(b), full_step_problems(b)
    assert b.runs[-1].captured == 0, "every graph was captured in the warm-up run"
    eager = b.launches_per_step("none")
    assert sum(eager.values()) > 50, "an eager step launches the whole program"
    us = b.us_per_step()
    assert set(us) == {*host_bench.STAGE_NAMES, "total"} and us["total"] > 0
    lines = host_bench.report(b)
    assert any(line.strip().endswith(REPLAY) for line in lines), lines


@pytest.mark.slow
def test_a_launch_added_to_a_full_step_is_named(monkeypatch):
    """A planted launch: the results copied back in two copies instead of one (an extra slice of the
    device results and a second copy), as the steps did before their results were packed."""
    from refengine.async_engine.runner import AsyncRunner

    outputs = AsyncRunner._outputs

    def copied_twice(self, plan, padded, fut, out):
        outputs(self, plan, padded, fut, out)
        fut.num_valid.copy_(out.verified.num_valid[: plan.shape.num_reqs], non_blocking=True)

    monkeypatch.setattr(AsyncRunner, "_outputs", copied_twice)
    problems = full_step_problems(small_bench())
    assert any(p.startswith(DTOH) for p in problems), problems


@pytest.mark.slow
def test_bench_host_cost_per_step(benchmark):
    """The default workload (K=3, FULL_AND_PIECEWISE), once, its figures kept in the benchmark's extra
    info. Run: ``pytest tests/fakecuda/test_host_bench.py -m slow --benchmark-only -p no:xdist``."""
    b = benchmark.pedantic(host_bench.run, kwargs={"k": 3, "graph_mode": "full_and_piecewise", "repeat": 1},
                           rounds=1, iterations=1)
    benchmark.extra_info.update(b.summary())
    assert not full_step_problems(b), full_step_problems(b)
