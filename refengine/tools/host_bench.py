"""``refengine bench --fake-cuda``: the async engine's host cost per step, by stage, with no kernel time.

The engine is built for ``device="cuda"`` and run on fake CUDA (``refengine.tools.fake_runtime``): its CUDA
code paths run, graph replays included, and every launch a GPU would see is counted by name, but no
kernel runs, so what is timed is the host. A step's results, which fake tensors cannot hold, come from
a real run of the same workload on the CPU (the same engine and settings; its steps are recorded
first): before a step is processed its host result tensors are filled with that run's values, so the
fake run schedules exactly the steps the real one did (checked row by row, and its tokens at the end).

Stages (the methods timed, each without the stages below it that run inside it):

    schedule   core.scheduler.schedule       the scheduler's choice of rows
    plan       planner.plan                  placement, the row table and the staged writes, on the host
    enqueue    runner.enqueue, .complete     the copies in, the step's future, the device work's launch
    stage      runner.stage                  the staged writes applied on the device
    program    runner.graphs.run             the step program's launches, or its graph's replay
    model      runner.run                    (inside program) the model's forward
    drafter    runner.proposer.propose       (inside program) the drafter's proposals
    outputs    runner._outputs               the copies of the results back to the host
    process    process                       the results read, committed, handed to the requests
    other      step                          the rest of the engine's step (its outputs delivered, ...)

Times are the host thread's CPU time (other processes on a shared machine do not count). Taken off:
the fake tensors' own Python (a FakeTensor op costs ~100-200 us where a CUDA launch costs a few), the
fake mode's entry for host-only ops and metadata queries (free on a GPU's host), and the stand-ins'
work. Kept: the dispatcher's entry into each device op (~20-60 us here, a few on a GPU's host: the
figure counts issuing a device op dearer than a GPU does); ``own_us_per_step`` takes its calibrated
estimate off too, leaving the host's own code. A Triton launch costs here none of what Triton's
launcher costs. Device ops and launches are counted per step.
The first run of the workload is a warm-up (it captures the graphs); the figures are medians over the
timed runs, launch counts the last run's.
"""

from __future__ import annotations

import copy
import json
import statistics
from collections import Counter
from dataclasses import dataclass, field

import torch

from refengine.tools.fake_runtime import FakeRuntime, clock

# (stage, object path from the engine, method, runs device work: the fake mode is entered around it)
STAGES = (
    ("other", "", "step", False),
    ("schedule", "core.scheduler", "schedule", False),
    ("plan", "planner", "plan", False),
    ("enqueue", "runner", "enqueue", True),
    ("enqueue", "runner", "complete", True),
    ("stage", "runner", "stage", False),
    ("program", "runner.graphs", "run", False),
    ("model", "runner", "run", False),
    ("drafter", "runner.proposer", "propose", False),
    ("outputs", "runner", "_outputs", False),
    ("process", "", "process", False),
)
STAGE_NAMES = tuple(dict.fromkeys(name for name, _, _, _ in STAGES))


@dataclass
class StepResult:
    """What one step of the real run returned: its rows (prompt index, tokens) and host results."""

    rows: list[tuple[int, int]]
    sampled: torch.Tensor  # [n, K+1] int64
    num_valid: torch.Tensor  # [n] int64
    num_drafts: torch.Tensor  # [n] int64


def _positions(engine) -> dict[str, int]:
    """request id -> its prompt's index in the current ``generate`` call, filled as requests are added."""
    positions: dict[str, int] = {}
    add = engine.add_request

    def add_request(request_id, prompt_token_ids, params):
        positions[request_id] = len(positions)
        return add(request_id, prompt_token_ids, params)

    engine.add_request = add_request
    return positions


def _rows(plan, positions: dict[str, int]) -> list[tuple[int, int]]:
    return [(positions[r.request.request_id], r.num_tokens) for r in plan.rows]


def record_results(llm, prompts, params) -> tuple[list[StepResult], list[list[int]]]:
    """One real run of the workload on ``llm`` (an async engine on the CPU): each step's results, in
    order, and the tokens of every request."""
    engine = llm.engine
    positions = _positions(engine)
    results: list[StepResult] = []
    process = engine.process

    def recording(fut):
        fut.event.wait()
        results.append(StepResult(_rows(fut.plan, positions), fut.sampled.clone(), fut.num_valid.clone(),
                                  fut.num_drafts.clone()))
        return process(fut)

    engine.process = recording
    outs = llm.generate(prompts, params)
    del engine.process, engine.add_request
    return results, [o.token_ids for o in outs]


class StageClock:
    """Host seconds per stage (each without the stages inside it), and the launch tag of the moment."""

    def __init__(self, rt: FakeRuntime):
        self.rt = rt
        self.seconds: Counter = Counter()  # stage -> host seconds
        self.steps: Counter = Counter()  # graph mode -> steps enqueued
        self.step_seconds: Counter = Counter()  # (graph mode, stage) -> host seconds in the engine steps
        #                                         that enqueued a step of that mode ("host": none)
        self._current: Counter = Counter()  # stage -> host seconds in the current engine step
        self._stack: list[list] = []  # [stage, start, fake seconds at start, children's seconds]
        self._mode = "host"  # the graph mode of the step whose device work is being launched
        self._step_mode = "host"  # the graph mode of the step the current engine step enqueued

    def clear(self) -> None:
        self.seconds.clear(), self.steps.clear(), self.step_seconds.clear()

    def tag(self) -> tuple[str, str]:
        """(the step's graph mode, or "host" outside its device work; the stage)."""
        return (self._mode if self._stack else "host", self._stack[-1][0] if self._stack else "outside")

    def wrap(self, name: str, fn, device: bool, counts_step: bool):
        rt = self.rt

        def timed(*args, **kwargs):
            frame = [name, clock(), rt.fake_seconds, 0.0]
            self._stack.append(frame)
            mode = self._mode
            try:
                if not device:
                    return fn(*args, **kwargs)
                plan = getattr(args[0], "plan", args[0])  # enqueue(plan), complete(fut, bitmask)
                self._mode = plan.shape.mode.value
                if counts_step:
                    self.steps[self._mode] += 1
                    self._step_mode = self._mode
                return rt.in_mode(fn, *args, **kwargs)
            finally:
                self._mode = mode
                spent = clock() - frame[1] - (rt.fake_seconds - frame[2])
                self._stack.pop()
                self.seconds[name] += spent - frame[3]
                self._current[name] += spent - frame[3]
                if self._stack:
                    self._stack[-1][3] += spent
                else:  # an engine step: its stages' time goes to the mode of the step it enqueued
                    for stage, seconds in self._current.items():
                        self.step_seconds[self._step_mode, stage] += seconds
                    self._current.clear()
                    self._step_mode = "host"

        return timed

    def install(self, engine) -> None:
        for name, path, method, device in STAGES:
            owner = engine
            for part in filter(None, path.split(".")):
                owner = getattr(owner, part, None)
            if owner is not None:  # no drafter without speculation
                setattr(owner, method, self.wrap(name, getattr(owner, method), device, method == "enqueue"))


def fake_engine(llm, rt: FakeRuntime):
    """An engine like ``llm.engine`` (the same class, settings and model) built for fake CUDA."""
    engine = llm.engine
    config = copy.copy(engine.config)
    config.device = "cuda"  # EngineConfig refuses "cuda" without a GPU at construction, not on assignment
    with rt.mode:
        return type(engine)(config, rt.module(engine.model), engine.core.model_config, llm.tokenizer)


def _fill(fake, rt: FakeRuntime, positions, results: list[StepResult], first: list[int]) -> None:
    """Before each step is processed, its host results are the real run's (a fake tensor holds none)."""
    process = fake.process

    def filled(fut):
        start = clock()
        i = fut.plan.index - first[0]
        if i >= len(results) or _rows(fut.plan, positions) != results[i].rows:
            raise SystemExit(f"bench --fake-cuda: step {i} differs from the real run's (the host's "
                             "scheduling must depend on the steps' results only)")
        res = results[i]
        fut.sampled.copy_(res.sampled)
        fut.num_valid.copy_(res.num_valid)
        fut.num_drafts.copy_(res.num_drafts)
        rt.fake_seconds += clock() - start  # the stand-in's work, not the host's
        return process(fut)

    fake.process = filled


@dataclass
class RunFigures:
    seconds: dict  # stage -> host seconds
    step_seconds: dict  # (graph mode, stage) -> host seconds of the engine steps that enqueued a step of it
    steps: dict  # graph mode -> steps
    launches: dict  # (graph mode, stage) -> Counter of launch names
    device_ops: dict  # (graph mode, stage) -> ops on device tensors (views included)
    events: dict  # (graph mode, stage) -> event records
    device_entries: dict  # (graph mode, stage) -> its device ops' calibrated entries into the fake mode, s
    taken_off: float  # seconds taken off (fake tensors, the mode's entries, the stand-ins)
    captured: int  # launches recorded into graphs captured during the run (0 after the warm-up)

    @property
    def num_steps(self) -> int:
        return sum(self.steps.values())


@dataclass
class HostBench:
    k: int
    graph_mode: str
    requests: int
    tokens: int
    entries: dict  # kind of op -> the fake mode's entry taken off per op, seconds (``FakeRuntime.calibrate``)
    runs: list[RunFigures] = field(default_factory=list)

    def us_per_step(self, issuing: bool = True) -> dict[str, float]:
        """stage -> median over the runs of host microseconds per step; "total" their sum. Without
        ``issuing``: the calibrated cost of issuing the device ops taken off too (the host's own code)."""
        def seconds(r: RunFigures, stage: str) -> float:
            off = 0.0 if issuing else sum(v for (_, s), v in r.device_entries.items() if s == stage)
            return r.seconds.get(stage, 0.0) - off

        out = {s: statistics.median(1e6 * seconds(r, s) / r.num_steps for r in self.runs)
               for s in STAGE_NAMES}
        out["total"] = statistics.median(1e6 * sum(seconds(r, s) for s in STAGE_NAMES) / r.num_steps
                                         for r in self.runs)
        return out

    def us_per_mode_step(self) -> dict[str, dict[str, float]]:
        """graph mode -> stage -> median host microseconds of an engine step that enqueued a step of that
        mode ("total": their sum)."""
        def per(r: RunFigures, m: str, stages) -> float:
            return 1e6 * sum(r.step_seconds.get((m, s), 0.0) for s in stages) / max(r.steps.get(m, 0), 1)

        out = {}
        for m in self.runs[0].steps:
            out[m] = {s: statistics.median(per(r, m, [s]) for r in self.runs) for s in STAGE_NAMES}
            out[m]["total"] = statistics.median(per(r, m, STAGE_NAMES) for r in self.runs)
        return out

    def steps(self) -> dict[str, int]:
        return dict(self.runs[-1].steps)

    def launches_per_step(self, mode: str | None = None) -> dict[str, float]:
        """launch name -> launches per step of graph mode ``mode`` (every step and stage when None)."""
        r = self.runs[-1]
        total: Counter = Counter()
        for (m, _), names in r.launches.items():
            if mode is None or m == mode:
                total.update(names)
        steps = r.steps.get(mode, 0) if mode is not None else r.num_steps
        return {name: n / max(steps, 1) for name, n in sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))}

    def by_stage(self, what: str) -> dict[str, float]:
        """stage -> ``"launches"`` or ``"device_ops"`` per step."""
        r = self.runs[-1]
        total: Counter = Counter()
        for (_, stage), n in getattr(r, what).items():
            total[stage] += sum(n.values()) if isinstance(n, Counter) else n
        return {s: total.get(s, 0) / r.num_steps for s in STAGE_NAMES}

    def summary(self) -> dict:
        """The figures as plain data (``--json``)."""
        modes = sorted(self.steps())
        return {"k": self.k, "graph_mode": self.graph_mode, "steps": self.steps(),
                "us_per_step": self.us_per_step(), "own_us_per_step": self.us_per_step(issuing=False),
                "us_per_mode_step": self.us_per_mode_step(), "launches_by_stage": self.by_stage("launches"),
                "device_ops_by_stage": self.by_stage("device_ops"),
                "launches_per_mode_step": {m: self.launches_per_step(m) for m in modes}}


def run(model: str | None = None, k: int = 3, graph_mode: str = "full_and_piecewise", repeat: int = 3,
        copies: int = 1, max_num_seqs: int = 16, prompts=None, params=None, calibration_rounds: int = 300,
        **settings) -> HostBench:
    """The host bench of the async engine on the default workload (or ``prompts`` / ``params``); ``settings``:
    more ``LLM`` settings (``block_size``, ...)."""
    from refengine import LLM
    from refengine.tools.default_workload import bench_workload

    llm = LLM(model=model, engine="async", num_speculative_tokens=k, graph_mode=graph_mode,
              max_num_seqs=max_num_seqs, **settings)
    if prompts is None:
        prompts, params = bench_workload(llm, copies, seed=0)
    results, tokens = record_results(llm, prompts, params)
    with FakeRuntime() as rt:
        fake = fake_engine(llm, rt)
        fake_llm = copy.copy(llm)
        fake_llm.engine = fake
        positions = _positions(fake)
        clock_ = StageClock(rt)
        rt.tag = clock_.tag
        clock_.install(fake)
        first = [0]
        _fill(fake, rt, positions, results, first)
        entries = rt.calibrate(calibration_rounds)
        bench = HostBench(k, str(graph_mode), len(prompts), sum(len(t) for t in tokens), entries)
        for i in range(1 + repeat):  # the first: warm-up (graph captures)
            positions.clear()
            first[0] = fake.planner.num_plans
            rt.clear()
            clock_.clear()
            outs = fake_llm.generate(prompts, params)
            if [o.token_ids for o in outs] != tokens:
                raise SystemExit("bench --fake-cuda: the fake run's tokens differ from the real run's")
            if i:
                launches = {t: Counter(c) for t, c in rt.launches.items()}
                figures = RunFigures(dict(clock_.seconds), dict(clock_.step_seconds), dict(clock_.steps),
                                     launches, dict(rt.device_ops), dict(rt.events), dict(rt.device_entries),
                                     rt.fake_seconds, sum(rt.captured.values()))
                bench.runs.append(figures)
        fake.close()
    llm.engine.close()
    return bench


def report(b: HostBench) -> list[str]:
    us, own, steps, per_mode = b.us_per_step(), b.us_per_step(issuing=False), b.steps(), b.us_per_mode_step()
    launches, ops = b.by_stage("launches"), b.by_stage("device_ops")
    lines = [(f"host cost per step on fake CUDA (no kernel time): K={b.k}, graph mode {b.graph_mode}, "
              f"{b.requests} requests, {b.tokens} tokens, {sum(steps.values())} steps a run "
              f"({', '.join(f'{m} {n}' for m, n in sorted(steps.items()))}), median of {len(b.runs)} runs"),
             f"  {'stage':10s} {'us/step':>9s} {'own us/step':>12s} {'launches/step':>14s} "
             f"{'device ops/step':>16s}" + "".join(f" {'us/' + m + ' step':>15s}" for m in sorted(steps))]
    for s in (*STAGE_NAMES, "total"):
        stage_launches = sum(launches.values()) if s == "total" else launches[s]
        stage_ops = sum(ops.values()) if s == "total" else ops[s]
        lines.append(f"  {s:10s} {us[s]:9.1f} {own[s]:12.1f} {stage_launches:14.2f} {stage_ops:16.2f}"
                     + "".join(f" {per_mode[m][s]:15.1f}" for m in sorted(steps)))
    for mode in sorted(steps):
        per = b.launches_per_step(mode)
        lines.append(f"  {mode} steps ({steps[mode]} a run): {sum(per.values()):.2f} launches each:")
        lines += [f"    {n:8.2f}  {name}" for name, n in per.items()]
    lines.append("  own us: without issuing the device ops either; the fake mode's entry per op, calibrated: "
                 + ", ".join(f"{kind} {1e6 * s:.1f} us" for kind, s in b.entries.items()))
    captured = b.runs[-1].captured
    if captured:
        lines.append(f"  note: {captured} launches were captured into graphs during a timed run")
    return lines


def main(args) -> int:
    """``refengine bench --fake-cuda`` with the bench's parsed arguments."""
    b = run(args.model, args.num_speculative_tokens, args.graph_mode, args.repeat, args.copies,
            args.max_num_seqs)
    print(json.dumps(b.summary()) if args.json else "\n".join(report(b)))
    return 0
