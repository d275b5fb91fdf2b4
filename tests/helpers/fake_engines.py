"""Both engines' device work replayed on fake CUDA (see tests/helpers/fake_cuda.py).

An engine runs a real workload on the CPU (the host logic: scheduling, prefix caching, preemption),
and a *twin* of its device side, built by the engine's own constructor for ``device="cuda"`` inside
``FakeTensorMode`` (persistent state, caches and a fake CUDA copy of the model's weights), replays
the device work of the steps it records:

- async engine: every step's plan is recorded at ``AsyncRunner.enqueue`` (its row table and staged
  writes copied, since the host reuses its buffers); the twin replays ``runner.stage(plan)`` (the
  plan's ``StagedWrites``: admissions, block-table growth, prefix-cache restores, one host-to-device
  copy) and then ``runner.program(shape, rows)``, the whole step program a FULL step captures as one
  graph, on the row table (the held checkpoint slots among its columns) padded as ``StepGraphs.pad``
  pads it. ``runner.program`` is the seam: past it the runner
  copies the results back to the host (the one sync per step, by design) and, on CUDA, captures and
  replays graphs, which needs a GPU.
- reference engine: each step's ``SchedulerOutput`` is executed by the twin's ``runner.execute`` right
  after the real one (same request state): the inputs built from host lists on the device, the model
  forward, the logits and the verification launch, and the prefix cache's restore and checkpoint
  copies. The reference reads the verifier's output back by design (it is synchronous): that read is
  answered with placeholder values, since the twin's results are discarded.

A twin step passes when the fake run raises nothing (no device mismatch, no host read, every Triton
launch as its kernel assumes) and, for the async engine, when no op of ``stage`` or ``program``
creates a tensor on the CPU. Packing the staged writes into the one host tensor that ``stage`` copies
(``StagedWrites.packed``) is host work, done before the watch; everything from the copy on is checked.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import kernels
from refengine import LLM, SamplingParams
from refengine.async_engine import engine as async_engine_module
from refengine.async_engine import runner as runner_module
from refengine.async_engine.graphs import PieceGraphs
from refengine.async_engine.inputs import StagedWrites, StepRows
from refengine.async_engine.runner import StepOutputs
from refengine.config import GraphMode
from refengine.model import registry
from refengine.tools.tiny_models import TINY_PREFIX, tiny_model_path
from tests.helpers.fake_cuda import CUDA, FakeCuda

# The staged writes (``StagedWrites`` piece names, refengine/async_engine/engine.py ``_writes``) that mark a
# step's kinds: an admission (or a resumption) and a prefix-cache hit's restore.
ADMISSION, RESTORES = "admit.idx", "restores"


class _NoStream:
    """The twin's stream: only its device is used (``program`` never touches the stream)."""

    def __init__(self, device, **_):
        self.device = torch.device(device)

    def close(self) -> None:
        pass


def _cuda_config(config):
    twin = copy.copy(config)
    twin.device = "cuda"  # EngineConfig refuses "cuda" without a GPU at construction, not on assignment
    return twin


# The checkpoints every family of the model registry contributes (its ``test_checkpoints``): case name ->
# a TinySpec preset of tests/helpers/checkpoints.py, a ``tiny:<family>`` preset, or None (the embedded
# default model).
FAMILY_CHECKPOINTS: dict[str, str | None] = {
    case: preset for family in registry.FAMILIES for case, preset in family.test_checkpoints
}
# Families of attention layers only: no recurrent state (no GDN kernels, no state checkpoints) and no MTP
# head (scripted drafts stand in for MTP drafts)
DENSE_FAMILIES = frozenset({"llama"})

# Waves of prompts: a shared system prefix published by the first wave and hit by the second, then more
# requests than the KV pool holds (preemption and resumption), prompts longer than a step's token budget
# (prefill chunks that sample nothing) next to running decodes (mixed steps), and a repetitive prompt the
# n-gram drafter finds drafts in (other rows get none).
SYSTEM = [(5 * j) % 250 for j in range(16)]
WAVES = [[SYSTEM + [1, 2]],
         [SYSTEM + [3, 4, 5], SYSTEM + [6], [(7 * 3 + j) % 250 for j in range(11)]],
         [list(b"the cat. the cat. the cat."), *[[(11 * i + j) % 250 for j in range(9 + 2 * i)]
                                                 for i in range(1, 5)]]]
# hazard_check: as the conformance suite runs the async engine (conformance/engines.py), its debugging
# checks inside the step program included, so they are held to what a capture allows too.
SETTINGS = {"block_size": 4, "num_kv_blocks": 20, "max_model_len": 60, "max_num_seqs": 4,
            "max_num_batched_tokens": 16, "enable_prefix_caching": True, "mamba_cache_mode": "all",
            "hazard_check": True}


def checkpoint_path(preset: str | None, tmp_path_factory) -> str | None:
    if preset is None:
        return None
    if preset.startswith(TINY_PREFIX):
        return tiny_model_path(preset)
    from tests.helpers.checkpoints import write_checkpoint

    return str(write_checkpoint(tmp_path_factory.mktemp(preset), preset))


# SamplingParams fields every other request of a recorded run carries: every logits processor the step
# program applies, logprobs (its logprob tables) and seeded sampling with every filter (its rejection
# sampler); ids small enough for every family's tiny vocabulary
REQUEST_PARAMS = {"logit_bias": {7: 2.0}, "min_tokens": 2, "repetition_penalty": 1.2,
                  "frequency_penalty": 0.3, "presence_penalty": 0.1, "allowed_token_ids": list(range(32)),
                  "logprobs": 2, "temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.02, "seed": 7}
# Structured outputs on some of the others where the model has a tokenizer (the embedded default model): its
# steps run in two parts, the host's grammar bitmask copied in between
GRAMMAR_PARAMS = {"structured_outputs": {"regex": "[a-z ]{1,40}"}}


def step_kinds(snap, k: int, drafter: str) -> set[str]:
    rows = StepRows.view(snap.inputs)
    shape = snap.shape
    out = set()
    decode = rows.is_decode.bool()
    if bool((~decode).any()):
        out.add("prefill")
    if bool((~decode & (rows.is_sampling == 0)).any()):
        out.add("prefill chunk")
    if bool(decode.any()) and bool((~decode).any()):
        out.add("mixed")
    if shape.mode is GraphMode.FULL:
        out.add("full decode")
    if bool(decode.any()) and k:
        out.add(f"verify {drafter}")
    if snap.writes.get(RESTORES) is not None:
        out.add("restore")
    caching = snap.sink_checkpoint is not None  # without prefix caching the table has no slot columns
    if caching and bool((rows.checkpoint_slots != snap.sink_checkpoint).any()):  # a slot held for a boundary
        out.add("checkpoint")
    if snap.writes.get(ADMISSION) is not None:
        out.add("admission")
    if snap.resumed:
        out.add("resumed")
    if snap.preempted:
        out.add("preempted")
    if shape.processors:
        out.add("full processors" if shape.mode is GraphMode.FULL else "processors")
    if shape.logprobs:
        out.add("logprobs")
    if shape.sampling:
        out.add("full sampling" if shape.mode is GraphMode.FULL else "sampling")
    if shape.grammar:
        out.add("full grammar" if shape.mode is GraphMode.FULL else "grammar")
    return out


def covering(snaps: list, k: int, drafter: str) -> tuple[list, set[str]]:
    """The first steps that together exercise every kind the run has (each adds a kind), and those kinds."""
    chosen, kinds = [], set()
    for snap in snaps:
        new = step_kinds(snap, k, drafter)
        if not new <= kinds:
            chosen.append(snap)
            kinds |= new
    return chosen, kinds


def _copy_writes(writes: StagedWrites, copy_tensor) -> StagedWrites:
    out = StagedWrites()
    for name, tensor in writes.pieces.items():
        out.add(name, copy_tensor(tensor))
    return out


def _snapshot(plan, sink_checkpoint: int | None):
    """The plan with what the host may reuse or change copied: the row table [n, F], the staged writes,
    the row lists. ``sink_checkpoint``: the slot a row holds for a boundary nobody asked for."""
    snap = copy.copy(plan)
    snap.inputs = plan.inputs.tensor[: plan.shape.num_reqs].clone()  # [n, F] the host buffer is reused
    snap.writes = _copy_writes(plan.writes, torch.Tensor.clone)
    snap.rows, snap.prefix_rows = list(plan.rows), list(plan.prefix_rows)
    snap.sink_checkpoint = sink_checkpoint
    return snap


class _Packed(StagedWrites):
    """Staged writes whose host packing was done already: ``packed()`` returns that one host tensor."""

    def __init__(self, writes: StagedWrites, packed: torch.Tensor):
        super().__init__()
        self.pieces = writes.pieces
        self._packed = packed

    def packed(self) -> torch.Tensor:
        return self._packed


@dataclass
class AsyncRun:
    llm: LLM
    snaps: list  # recorded step plans, in order
    k: int
    drafter: str
    records: list  # the real run's StepRecords

    def draft_counts(self) -> set[int]:
        """How many drafts the decode rows of the real run verified (an n-gram step proposes 0..K)."""
        return {len(row.draft_token_ids) for rec in self.records for row in rec.rows if row.kind == "decode"}


def record_async(prompts: list, *, max_tokens: int = 8, request_params: dict | None = None,
                 grammar_params: dict | None = None, **settings) -> AsyncRun:
    """A real async run on the CPU, every step's plan recorded. ``prompts``: one list of prompts per wave
    (each wave a ``generate`` call, so a later wave can hit what an earlier one published);
    ``request_params``: SamplingParams fields every other prompt of a wave carries (logits processors,
    logprobs, sampling), so steps with and without them are recorded; ``grammar_params``: the fields
    (structured outputs) every fourth prompt carries, from the third, instead of none."""
    records: list = []
    llm = LLM(engine="async", observer=records.append, **settings)
    runner, snaps = llm.engine.runner, []
    enqueue = runner.enqueue

    def record(plan):
        snaps.append(_snapshot(plan, runner.sink_checkpoint))
        return enqueue(plan)

    runner.enqueue = record
    complete = runner.complete

    def record_bitmask(fut, bitmask):
        next(s for s in reversed(snaps) if s.index == fut.plan.index).bitmask = bitmask.tensor.clone()
        return complete(fut, bitmask)

    runner.complete = record_bitmask
    plain = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    carrying = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **(request_params or {}))
    constrained = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **(grammar_params or {}))

    def params(i: int) -> SamplingParams:
        if i % 2:
            return carrying if request_params else plain
        return constrained if i % 4 == 2 and grammar_params else plain

    for wave in prompts:
        llm.generate(wave, [params(i) for i in range(len(wave))])
    return AsyncRun(llm, snaps, settings.get("num_speculative_tokens", 0), settings.get("drafter", "mtp"),
                    records)


@contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class AsyncTwin:
    """The device side of ``engine`` (an ``AsyncEngine``) on fake CUDA."""

    def __init__(self, fc: FakeCuda, engine):
        self.fc = fc
        with fc, _patched(async_engine_module, "Stream", _NoStream):
            model = fc.module(engine.model)
            # the engine's debugging checks too: those inside the step program must be capture-safe
            self.engine = type(engine)(_cuda_config(engine.config), model, engine.core.model_config,
                                       hazard_check=engine.stream.hazard_check)
        self.runner = self.engine.runner
        assert self.runner.device.type == "cuda" and self.engine.state.num_computed.is_cuda
        # The twin runs step programs without capturing them (fake CUDA has no graphs); piecewise steps
        # go through the piece driver's emulated replays, so their pieces' device work is checked too.
        self.runner.pieces = PieceGraphs(self.runner.device, emulate=True)

    def stage(self, snap) -> list[str]:
        """Replay ``runner.stage`` for a recorded plan; returns the ops that made CPU tensors."""
        fc, plan = self.fc, copy.copy(snap)
        memo: dict = {}
        writes = _copy_writes(snap.writes, lambda t: fc.host(t, memo))
        plan.writes = _Packed(writes, writes.packed())  # host work: the one staging tensor [sum of sizes]
        plan.drafter_admission = fc.host(snap.drafter_admission, memo)
        # Fake tensors have no pinned host memory; the copy itself is what is checked.
        to_device = _patched(runner_module, "to_device", lambda t, dev: t.to(dev, non_blocking=True))
        with to_device, fc.watching() as watch:
            self.runner.stage(plan)
        return watch.cpu_ops

    def table(self, snap) -> torch.Tensor:
        """The step's row table on the device, padded as ``StepGraphs.pad`` pads it: [Np, F]."""
        n = snap.shape.num_reqs
        width = StepRows.width(self.runner.num_checkpoint_columns)  # as ``AsyncRunner.enqueue`` sizes it
        table = torch.empty(n, width, dtype=torch.int64, device=CUDA)
        table.copy_(self.fc.host(snap.inputs), non_blocking=True)
        return self.runner.graphs.pad(snap.shape, table, self.runner._inert)

    def program(self, snap, padded: torch.Tensor) -> tuple[StepOutputs, list[str]]:
        with self.fc.watching() as watch:
            out = self.runner.program(snap.shape, StepRows.view(padded))
        return out, watch.cpu_ops

    def parts(self, snap, padded: torch.Tensor) -> tuple[StepOutputs, list[str]]:
        """A structured-outputs step as the engine runs it: ``forward``, the grammar bitmask copied into its
        static buffer (the host built it, [Np, K+1, W]), then ``finish``."""
        runner, rows = self.runner, StepRows.view(padded)
        with self.fc.watching() as watch:
            staged = runner.forward(snap.shape, rows)
            n_pad = snap.shape.num_reqs_padded
            runner.grammar_mask[:n_pad].copy_(self.fc.host(snap.bitmask), non_blocking=True)
            out = runner.finish(snap.shape, rows, *staged)
        return out, watch.cpu_ops

    def step(self, snap) -> StepOutputs:
        """Stage and run one recorded step; raises on a host read, a device mismatch or a bad launch,
        asserts no CPU tensor was created."""
        with self.fc:
            cpu = self.stage(snap)
            assert not cpu, f"staging created tensors on the CPU: {cpu}"
            run = self.parts if snap.shape.grammar else self.program
            out, cpu = run(snap, self.table(snap))
            assert not cpu, f"the step program created tensors on the CPU: {cpu}"
            n_pad = snap.shape.num_reqs_padded
            assert out.verified.sampled.shape == (n_pad, self.runner.num_speculative_tokens + 1)
            assert out.verified.sampled.is_cuda and out.next_drafts.is_cuda
        return out


class _HostRead(list):
    """A placeholder for a tensor the reference engine reads back (``.tolist()``) by design."""

    def tolist(self):
        return list(self)


def reference_kind(sched) -> tuple:
    """(prefill rows, prefill chunks that sample nothing, decode rows, decode rows with drafts) present."""
    rows = sched.rows
    return (any(r.request.is_prefilling for r in rows), any(not r.samples for r in rows),
            any(not r.request.is_prefilling for r in rows), any(r.draft_token_ids for r in rows))


def record_reference(prompts: list, fc: FakeCuda, *, max_tokens: int = 8,
                     on_step: Callable | None = None, **settings) -> tuple[LLM, list]:
    """A real reference run on the CPU whose every step (and prefix-cache copy) a fake CUDA twin repeats;
    returns the LLM and the twin's step results."""
    llm = LLM(engine="reference", **settings)
    engine = llm.engine
    with fc, _patched(async_engine_module, "Stream", _NoStream):
        model = fc.module(engine.model)
        twin = type(engine)(_cuda_config(engine.config), model, engine.core.model_config)
    assert twin.runner.device.type == "cuda"
    results = []
    execute = engine.runner.execute
    verify = kernels.greedy_verify

    def verify_then_placeholder(logits, drafts, num_drafts, cu, **kw):
        tokens, num_valid = verify(logits, drafts, num_drafts, cu, **kw)
        assert tokens.is_cuda and num_valid.is_cuda
        n, width = tokens.shape
        return _HostRead([[0] * width] * n), _HostRead([1] * n)

    seen: set = set()

    def execute_both(sched, record_digests=False):
        result = execute(sched, record_digests)
        kind = reference_kind(sched)
        if kind not in seen:  # one step of each kind: the device work of a kind does not depend on values
            seen.add(kind)
            # The CPU engine steps in inference mode and a CUDA engine does not (Engine._inference_mode):
            # the twin runs as a CUDA engine would.
            with torch.inference_mode(False), fc, _patched(kernels, "greedy_verify", verify_then_placeholder):
                results.append(twin.runner.execute(sched, False))
        return result

    def mirror(name):
        real = getattr(engine.caches, name)

        def both(*args):
            real(*args)
            with torch.inference_mode(False), fc:
                getattr(twin.caches, name)(*args)
            results.append(name)

        setattr(engine.caches, name, both)

    engine.runner.execute = execute_both
    mirror("restore_checkpoint")
    mirror("save_checkpoint")
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for wave in prompts:
        llm.generate(wave, params)
    return llm, results
