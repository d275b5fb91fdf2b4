"""Run a scenario through the reference engine and the engine under test, then check the traces."""

from __future__ import annotations

import shlex
import time
import traceback
from dataclasses import dataclass, field, replace

from conformance import checks, reference_cache
from conformance.adapters import load_engine
from conformance.adapters.refengine import cached_reference_adapter, reference_adapter
from conformance.api import DRAFTER_FEATURES, EngineAdapter, RequestParams, RunSpec
from conformance.model import ModelFacts, cut_refused
from conformance.results import NA, CheckResult, ScenarioResult
from conformance.trace import Recorder, Trace
from conformance.verdict import Verdict, choose
from conformance.watchdog import DEFAULT_STEP_TIMEOUT, EngineHang, Watch, run_watched
from conformance.workloads import EngineSettings, RequestSpec, Scenario, get_def, seed_of
from conformance.workloads.scenario import EAGLE_DRAFTERS, TEXT_PARAMS

REFERENCE_LABEL = "reference"
PLAIN_LABEL = "plain greedy (K=0, no aborts)"
CACHED_LABEL = "reference with prefix caching"
BARE_LABEL = "reference without the request parameters"
# Under --verdict rescored, an engine declaring "bitwise" judged by a reference in another dtype or on another
# device (Verdict.bitwise_in_own_dtype) is held bitwise to the reference engine in its own dtype on its device
# too: these runs (the keys of ``run_traces``; the labels are the exact verdict's, so the reference cache of
# an exact run in that dtype serves them).
OWN_DTYPE_TRACES = ("reference-own", "plain-own")


class NoProgress(RuntimeError):
    pass


class AbortsUnsupported(RuntimeError):
    """The scenario aborts requests, but the engine instance has no ``abort``."""


def run_workload(
    adapter: EngineAdapter,
    scenario: Scenario,
    facts: ModelFacts,
    *,
    label: str,
    settings: EngineSettings | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    step_timeout: float | None = DEFAULT_STEP_TIMEOUT,
    tensor_parallel_size: int = 1,
) -> Trace:
    """Feed the scenario's requests at their arrival steps and record everything the engine reports.

    Before the engine's step ``s`` the harness adds every request arriving at ``s``, then aborts every
    request whose ``abort_step`` is ``s`` or earlier and whose output has not come back yet, through
    the instance's optional ``abort(request_id) -> RequestOutput | None`` (None: the request had already
    finished inside the engine and a later ``step()`` returns it). An instance without ``abort`` cannot
    run a scenario with aborts: ``AbortsUnsupported`` is raised (the scenario is then skipped). A request
    that ``extends`` another is added once that one's output came back (at its own arrival step, or
    before the first step after the output), with that one's prompt and output before its own tokens.

    An exception from the engine ends the run; it is recorded in ``trace.error`` (the "runs" check
    reports it) rather than raised. So is a call into the engine (``start``, ``add_request``, ``step``,
    ...) that has not returned after ``step_timeout`` seconds: the engine is abandoned on its thread
    (conformance.watchdog) and the error names the call and the engine step.
    """
    import torch

    cache_key = reference_cache.key(adapter, scenario, facts, label, settings, device, dtype)
    if (stored := reference_cache.get(cache_key)) is not None:
        return stored
    settings = settings or scenario.settings
    recorder = Recorder(label, scenario.id)
    watch = Watch(step_timeout)
    torch.manual_seed(seed_of(scenario.id) % (1 << 31))
    pending = sorted(scenario.requests, key=lambda r: (r.arrival_step, r.request_id))
    aborts = sorted((r.abort_step, r.request_id) for r in scenario.requests if r.abort_step is not None)
    turns = 1 + sum(r.extends is not None for r in scenario.requests)  # a next turn holds earlier turns
    limit = 1000 + 20 * turns * sum(len(r.prompt) + r.max_tokens for r in scenario.requests)
    progress = {"step": 0}  # engine steps run so far, read when the run is abandoned
    added: set[str] = set()
    call = watch.call
    try:
        spec = RunSpec(facts.path, settings, facts.vocab_size, watch.guard(recorder.on_step), device,
                       dtype=dtype, tensor_parallel_size=tensor_parallel_size)
        engine = run_watched(lambda: call("start()", adapter.start, spec), watch, label)
        reference_cache.after_start(adapter, engine, spec)
        if isinstance(getattr(engine, "block_size", None), int):  # an engine that picks its own block size
            recorder.trace.block_size = engine.block_size
    except EngineHang as e:
        recorder.trace.error = f"{label}: {e}"
        return recorder.finish(settings.k > 0)
    except Exception:  # noqa: BLE001 - see below
        recorder.trace.error = traceback.format_exc()
        return recorder.finish(settings.k > 0)
    if aborts and not callable(getattr(engine, "abort", None)):
        raise AbortsUnsupported(f"{adapter.name}: the engine instance has no abort(request_id), and this "
                                f"scenario aborts {len(aborts)} request(s)")

    def drive() -> None:
        step = next_abort = 0
        at = "before the first engine step"
        try:
            while pending or call(f"has_unfinished() {at}", engine.has_unfinished):
                if not call(f"has_unfinished() {at}", engine.has_unfinished):
                    step = max(step, _next_arrival(pending, recorder.trace))  # idle until the next arrival
                for r in [r for r in pending if r.arrival_step <= step and _ready(r, recorder.trace)]:
                    call(f"add_request({r.request_id!r}) {at}", engine.add_request, r.request_id,
                         _prompt(r, recorder.trace),
                         RequestParams(r.max_tokens, r.ignore_eos, tuple(r.stop_token_ids), r.sampling))
                    recorder.on_added(r.request_id, step)
                    added.add(r.request_id)
                    pending.remove(r)
                while next_abort < len(aborts) and aborts[next_abort][0] <= step:
                    rid = aborts[next_abort][1]
                    next_abort += 1
                    if rid in added and rid not in recorder.trace.requests:
                        out = call(f"abort({rid!r}) {at}", engine.abort, rid)
                        live = len(added) - len(recorder.trace.requests) - (out is not None)
                        occupancy = getattr(engine, "occupancy", None)
                        recorder.on_abort(rid, step, out, live,
                                          None if occupancy is None else call("occupancy()", occupancy))
                if not call(f"has_unfinished() {at}", engine.has_unfinished) and pending:
                    continue  # every live request was aborted: idle until the next arrival
                for out in call(f"step() at engine step {step}", engine.step):
                    recorder.on_output(out, step + 1)
                step += 1
                progress["step"] = step
                at = f"after engine step {step - 1}"
                if step > limit:
                    raise NoProgress(f"no completion after {limit} steps")
            recorder.trace.pools_empty = (call("pools_empty()", engine.pools_empty)
                                          if adapter.supports("pools") else None)
            slots = getattr(engine, "request_slots_in_use", None)
            recorder.trace.request_slots_in_use = None if slots is None else call("request_slots_in_use()",
                                                                                   slots)
            occupancy = getattr(engine, "occupancy", None)
            recorder.trace.occupancy = (
                None if occupancy is None else {k: int(v) for k, v in dict(call("occupancy()", occupancy))
                                                .items()}
            )
        except Exception:  # noqa: BLE001 - the engine under test may fail in any way; the report shows how
            recorder.trace.error = traceback.format_exc()
        recorder.trace.num_engine_steps = step

    try:
        run_watched(drive, watch, label)
    except EngineHang as e:  # the abandoned engine's thread can no longer touch the recorder
        recorder.trace.error = f"{label}: {e}"
        recorder.trace.num_engine_steps = progress["step"]
    else:
        _close(engine, recorder, watch, label)
    if not adapter.supports("step_records") and "rows" not in recorder.trace.missing_fields:
        recorder.trace.missing_fields.append("rows")  # the per-step checks are n/a, naming it
    trace = recorder.finish(settings.k > 0)
    reference_cache.put(cache_key, trace)
    return trace


def _close(engine, recorder: Recorder, watch: Watch, label: str) -> None:
    """Release the engine through its optional ``close()`` (an outside engine holds threads, processes and
    memory); a close that fails or hangs is the engine's error, recorded like any other."""
    close = getattr(engine, "close", None)
    if not callable(close):
        return
    try:
        run_watched(lambda: watch.call("close()", close), watch, label)
    except EngineHang as e:
        recorder.trace.error = recorder.trace.error or f"{label}: {e}"
    except Exception:  # noqa: BLE001 - as for the engine's other calls
        recorder.trace.error = recorder.trace.error or traceback.format_exc()


def _ready(r: RequestSpec, trace: Trace) -> bool:
    """Whether ``r`` can be added: it extends no request, or that request's output came back."""
    return r.extends is None or r.extends in trace.requests


def _prompt(r: RequestSpec, trace: Trace) -> list[int] | str:
    if r.extends is not None:
        src = trace.requests[r.extends]
        return [*src.prompt_token_ids, *src.token_ids, *r.prompt]
    return r.prompt if isinstance(r.prompt, str) else list(r.prompt)


def _next_arrival(pending: list[RequestSpec], trace: Trace) -> int:
    """The arrival step of the next request that can be added while the engine is idle."""
    ready = [r.arrival_step for r in pending if _ready(r, trace)]
    if not ready:
        waiting = ", ".join(f"{r.request_id} (extends {r.extends})" for r in pending)
        raise NoProgress(f"the engine is idle, but {waiting} wait(s) for an output that never came back")
    return min(ready)


@dataclass(frozen=True)
class Case:
    """Everything one scenario run needs besides the scenario itself."""

    engine: str  # the selection as given: "async", "reference", "pkg.mod:factory"
    adapter: EngineAdapter
    facts: ModelFacts
    model_arg: str | None  # what the user passed as --model (None: embedded default)
    tier: str = "default"
    device: str = "cpu"
    dtype: str = "float32"  # both engines ("auto" already resolved to the checkpoint's dtype)
    # Prefix caching for the engine under test in every scenario (``--enable-prefix-caching``), in the
    # scenario's own mode unless ``mamba_cache_mode`` names one; the oracle still runs without a cache.
    enable_prefix_caching: bool = False
    mamba_cache_mode: str | None = None
    step_timeout: float | None = DEFAULT_STEP_TIMEOUT  # seconds one engine call may take (None: no limit)
    # A trigger a scenario's reference run misses is a warning ("not exercised"), not a failure: on any
    # model, by default, a scenario that did not test what it exists for fails (--allow-unexercised).
    allow_unexercised: bool = False
    # Every speculating scenario with this drafter instead of its own (``--drafter``; "draft_model" with
    # ``draft_model``, a folder or "cut:<layers>"; "eagle" | "eagle3" with the head's folder, or without: the
    # suite's seeded head for the model): a trigger tuned to the scenario's own drafter that the reference
    # run then misses is a warning, as with ``allow_unexercised``.
    drafter: str | None = None
    draft_model: str | None = None
    tensor_parallel_size: int = 1  # the engine under test's ranks (``--tensor-parallel-size``); the oracle: 1
    # How its tokens are judged (conformance.verdict): "exact" | "rescored" | "auto"; under "rescored" the
    # reference runs (and scores) in ``reference_dtype`` on ``reference_device`` (None: the engine's), with
    # ``tolerance`` nats instead of the calibrated one when given.
    verdict: str = "exact"
    reference_dtype: str | None = None
    reference_device: str | None = None
    tolerance: float | None = None
    # Every trigger and every bound the checkpoint decides must be exercised too (``--require-exercised``):
    # a miss fails its check instead of being "not exercised" (a warning and a named gap in the reports).
    require_exercised: bool = False
    judged: Verdict = field(init=False, repr=False, compare=False)  # the verdict resolved (__post_init__)

    def __post_init__(self):
        bitwise = self.verdict != "exact" and self.adapter.supports("bitwise")  # exact asks no adapter
        object.__setattr__(self, "judged", choose(
            self.verdict, bitwise=bitwise, dtype=self.dtype, reference_dtype=self.reference_dtype,
            device=self.device, reference_device=self.reference_device, tolerance=self.tolerance))
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {self.tensor_parallel_size}")
        if self.require_exercised and self.allow_unexercised:
            raise ValueError("--require-exercised asks for every trigger, --allow-unexercised lets a "
                             "missed one warn: give one of them")
        if self.step_timeout is not None and self.step_timeout <= 0:
            raise ValueError(f"step timeout must be > 0 seconds, got {self.step_timeout}")
        if self.mamba_cache_mode is not None and not self.enable_prefix_caching:
            raise ValueError(f"mamba_cache_mode={self.mamba_cache_mode!r} needs enable_prefix_caching")
        if (self.drafter == "draft_model" and self.draft_model is None) or (
                self.draft_model is not None and self.drafter not in ("draft_model", *EAGLE_DRAFTERS)):
            raise ValueError(f"--draft-model goes with --drafter draft_model, which needs one, or --drafter "
                             f"eagle|eagle3 (got drafter {self.drafter!r}, draft model {self.draft_model!r})")

    def apply(self, scenario: Scenario) -> Scenario:
        """``scenario`` as this case runs it: with the case's drafter when it names one, and prefix caching on
        when the case asks for it."""
        if self.drafter is not None and scenario.settings.k:
            draft_model = self.draft_model if self.drafter in ("draft_model", *EAGLE_DRAFTERS) else None
            scenario = replace(scenario, settings=replace(
                scenario.settings, drafter=self.drafter, pattern="hash", prompt_lookup_min=None,
                prompt_lookup_max=None, draft_model=draft_model))
        if not self.enable_prefix_caching:
            return scenario
        mode = self.mamba_cache_mode or scenario.settings.mamba_cache_mode
        return replace(scenario, settings=replace(scenario.settings, enable_prefix_caching=True,
                                                  mamba_cache_mode=mode))

    def replay_command(self, scenario_id: str, request_id: str | None = None,
                       scenario_file: str | None = None) -> str:
        cmd = ["conformance", "replay"]
        cmd += ["--scenario-file", scenario_file] if scenario_file is not None else [scenario_id]
        if request_id is not None:
            cmd += ["--request", request_id]
        cmd += ["--engine", self.engine]
        if scenario_file is None:
            cmd += ["--tier", self.tier]
        if self.model_arg is not None:  # a tiny preset by its name: its folder is versioned
            cmd += ["--model", self.model_arg if self.model_arg.startswith("tiny:") else self.facts.path]
        if self.device != "cpu":
            cmd += ["--device", self.device]
        if self.dtype != "float32":
            cmd += ["--dtype", self.dtype]
        if self.enable_prefix_caching:
            cmd.append("--enable-prefix-caching")
        if self.mamba_cache_mode is not None:
            cmd += ["--mamba-cache-mode", self.mamba_cache_mode]
        if self.drafter is not None:
            cmd += ["--drafter", self.drafter]
        if self.draft_model is not None:
            cmd += ["--draft-model", self.draft_model]
        if self.tensor_parallel_size != 1:
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.verdict != "exact":
            cmd += ["--verdict", self.verdict]
        for flag, value in (("--reference-dtype", self.reference_dtype),
                            ("--reference-device", self.reference_device)):
            if value is not None:
                cmd += [flag, value]
        if self.tolerance is not None:
            cmd += ["--tolerance", repr(self.tolerance)]
        return shlex.join(cmd)

    @property
    def own_dtype_where(self) -> dict | None:
        """Where the reference runs the bitwise checks are held to run (the engine's dtype and device), under
        a verdict that holds them to the reference in the engine's own dtype; else None."""
        if not self.judged.bitwise_in_own_dtype:
            return None
        return {"device": self.device, "dtype": self.dtype, "step_timeout": self.step_timeout}

    @property
    def reference_where(self) -> dict:
        """Where the reference side runs: the engine's dtype and device, or the verdict's reference's."""
        return {"device": self.reference_device or self.device, "dtype": self.judged.reference_dtype,
                "step_timeout": self.step_timeout}

    def adapter_for(self, scenario: Scenario) -> EngineAdapter:
        """The adapter to run ``scenario`` with: an engine selected as plain ``async`` runs in the
        scenario's graph mode when it names one; every other selection runs as given."""
        if self.engine == "async" and scenario.graph_mode is not None:
            return load_engine(f"async:{scenario.graph_mode}")
        return self.adapter

    @property
    def default_model(self) -> bool:
        """Running on the shipped default model."""
        return self.model_arg is None


def needed_features(scenario: Scenario) -> list[str]:
    """What the scenario needs of the engine under test beyond plain greedy decoding: the adapter
    features (conformance.api.FEATURES) of its drafter and its prefix caching, and "abort" (the
    instance's optional ``abort``) when it aborts requests."""
    s, need = scenario.settings, []
    if s.k:
        need.append(DRAFTER_FEATURES[s.drafter])
    if s.enable_prefix_caching:
        need.append("prefix_caching")
    if scenario.aborted:
        need.append("abort")
    return need


def skip_reason(scenario: Scenario, case: Case) -> str | None:
    s, facts = scenario.settings, case.facts
    refuses = getattr(case.adapter, "refuses", None)  # an outside engine's own limits, with the reason
    if callable(refuses) and (why := refuses(scenario, facts.path)) is not None:
        return f"the engine under test cannot run it: {why}"
    if s.k and s.drafter == "mtp" and not facts.has_mtp:
        return "the model has no MTP head (mtp.* weights; `refengine add-mtp-head` adds one)"
    if s.k and not case.adapter.supports(DRAFTER_FEATURES[s.drafter]):
        return f"the engine under test does not support the {s.drafter} drafter"
    if s.enable_prefix_caching and not case.adapter.supports("prefix_caching"):
        return "the engine under test does not support prefix caching"
    cut = cut_refused(s.draft_model, facts) if s.k and s.drafter == "draft_model" else None
    if cut is not None:
        return cut
    if any(isinstance(r.prompt, str) for r in scenario.requests) and not facts.has_tokenizer:
        return "text prompts need a model with a tokenizer"
    if not facts.has_tokenizer and any(n in TEXT_PARAMS for r in scenario.requests for n, _ in r.params):
        return "stop strings, bad words and structured outputs need a model with a tokenizer"
    if not facts.eos_token_ids and any(
            n == "structured_outputs" for r in scenario.requests for n, _ in r.params):
        return ("structured outputs need a model with an EOS token (config.json eos_token_id): a grammar "
                "ends its output on one")
    bad = [
        t
        for r in scenario.requests
        if not isinstance(r.prompt, str)
        for t in (*r.prompt, *r.stop_token_ids, *r.sampling.get("allowed_token_ids", ()),
                  *r.sampling.get("logit_bias", {}))
        if not 0 <= t < facts.vocab_size
    ]
    if bad:
        return f"token id {bad[0]} is outside the model's vocabulary [0, {facts.vocab_size})"
    return None


def run_scenario(scenario: str | Scenario, case: Case, scenario_file: str | None = None, *,
                 fail_fast: bool = False, only: str | None = None) -> tuple[ScenarioResult, dict[str, Trace]]:
    """Run one scenario (an id of the corpus, or a materialised Scenario); returns its result and the
    traces ("reference", "test", "plain" when the scenario speculates or aborts, "cached" when it caches).

    "plain" is the reference engine on the same workload with K=0 and no aborts: the output
    speculation must not change, and the continuation an aborted request's output is a prefix of.
    "cached" is the reference engine with the scenario's prefix caching: the oracle runs without a
    cache, and the reference engine's own cache must change nothing either ("cache-lossless").

    ``fail_fast``: stop at the first failing check. The checks that read only the reference and the
    engine under test run first, the plain and cached runs only when none of those failed; the result
    then holds the checks up to the failing one.

    ``only``: the result holds that check alone (a fuzz shrink asks one check); when it reads neither of
    the later runs, they are not made.
    """
    start = time.perf_counter()
    if isinstance(scenario, str):
        scenario = get_def(scenario).materialize(case.tier, case.facts.vocab_size)
    scenario = case.apply(scenario)
    result = ScenarioResult(
        scenario.id,
        scenario.description,
        case.tier,
        case.engine,
        case.facts.label,
        describe_settings(scenario),
        replay=case.replay_command(scenario.id, scenario_file=scenario_file),
        dtype=case.dtype,
        features=needed_features(scenario),
        family=case.facts.family,
        verdict=case.judged.mode,
        reference_dtype=case.judged.reference_dtype,
        tolerance=case.judged.tolerance if case.judged.rescored else None,
        model_name=case.model_arg or "",
    )
    traces: dict[str, Trace] = {}
    result.skipped = skip_reason(scenario, case)
    only_check = None if only is None else checks.declaration(only)
    if only is not None and only_check is None:
        raise ValueError(f"no check is named {only!r}")
    early_only = only_check is not None and not only_check.late
    if result.skipped is None:
        try:
            traces = run_traces(scenario, case, fail_fast=fail_fast or early_only)
        except AbortsUnsupported as e:
            result.skipped = f"aborts cannot run: {e}"
    if result.skipped is None:
        if _infrastructure_error(result, traces):
            pass
        elif only is not None:
            result.checks = evaluate(scenario, traces, case, scenario_file, early=early_only, only=only)
        elif fail_fast:
            result.checks = evaluate(scenario, traces, case, scenario_file, fail_fast=True, early=True)
            if not any(c.failed for c in result.checks):
                traces.update(late_traces(scenario, case, traces))
                if not _infrastructure_error(result, traces):
                    result.checks = evaluate(scenario, traces, case, scenario_file, fail_fast=True)
        else:
            result.checks = evaluate(scenario, traces, case, scenario_file)
    result.duration_s = time.perf_counter() - start
    return result, traces


def _infrastructure_error(result: ScenarioResult, traces: dict[str, Trace]) -> bool:
    """Record (in ``result.error``) a reference run that broke: no verdict on the engine under test."""
    if traces["reference"].error is not None:
        result.error = "the reference engine failed on this workload:\n" + traces["reference"].error
    elif "plain" in traces and traces["plain"].error is not None:
        result.error = "the reference engine failed on the plain (K=0, no aborts) workload:\n" + \
            traces["plain"].error
    elif "bare" in traces and traces["bare"].error is not None:
        result.error = "the reference engine failed on the workload without request parameters:\n" + \
            traces["bare"].error
    else:
        for key in (k for k in OWN_DTYPE_TRACES if k in traces and traces[k].error is not None):
            result.error = ("the reference engine in the engine's own dtype (the bitwise checks are held to "
                            f"it) failed on the {'plain (K=0, no aborts) ' if key == 'plain-own' else ''}"
                            "workload:\n" + traces[key].error)
            break
    return result.error is not None


def describe_settings(scenario: Scenario) -> str:
    text = scenario.settings.describe()
    if scenario.graph_mode is not None:
        text += f" graph_mode={scenario.graph_mode} (for async)"
    if scenario.aborted:
        text += f" aborts={len(scenario.aborted)}"
    return text


def run_traces(scenario: Scenario, case: Case, fail_fast: bool = False) -> dict[str, Trace]:
    """The traces of ``run_scenario``: "reference", "test", "plain" when the scenario speculates or aborts,
    "test-plain" (the engine under test on the plain workload) when it speculates and its output differs
    from plain greedy output, and "cached" (the reference engine with the scenario's prefix caching) when
    it caches; when the engine under test is the reference engine itself, its trace is that run.
    ``fail_fast``: only the first two (``late_traces`` gives the others)."""
    ref_side = reference_adapter()
    where = {"device": case.device, "dtype": case.dtype, "step_timeout": case.step_timeout}
    traces = {"reference": run_workload(ref_side, scenario, case.facts, label=REFERENCE_LABEL,
                                        **case.reference_where)}
    if traces["reference"].error is not None:
        return traces
    label = "reference (under test)" if case.engine == "reference" else case.engine
    traces["test"] = run_workload(case.adapter_for(scenario), scenario, case.facts, label=label, **where,
                                  tensor_parallel_size=case.tensor_parallel_size)
    if (own := case.own_dtype_where) is not None:  # the bitwise checks are held to it
        traces["reference-own"] = _own_dtype(run_workload(ref_side, scenario, case.facts,
                                                          label=REFERENCE_LABEL, **own), case)
    if not fail_fast:
        traces.update(late_traces(scenario, case, traces))
    return traces


def late_traces(scenario: Scenario, case: Case, traces: dict[str, Trace]) -> dict[str, Trace]:
    """The "plain", "test-plain" and "cached" runs of ``run_traces``, given its first two."""
    ref_side = reference_adapter()
    where = {"device": case.device, "dtype": case.dtype, "step_timeout": case.step_timeout}
    on_ref = case.reference_where  # the reference side: in the verdict's reference dtype
    label = "reference (under test)" if case.engine == "reference" else case.engine
    traces = dict(traces)
    # The reference engine's runs are the engine under test's own only where it is bitwise the reference;
    # where not, a batch-invariant engine is held to its own K=0 run (--verdict rescored).
    same = case.engine == "reference" and (not case.judged.rescored or case.judged.bitwise_comparable)
    own = case.own_dtype_where  # held bitwise to the reference in its own dtype: its plain run is that one's
    own_plain = (not same and own is None and case.judged.rescored and not case.judged.bitwise_comparable
                 and case.adapter.supports("batch_invariant") and bool(scenario.k or scenario.aborted))
    if scenario.k or scenario.aborted:
        traces["plain"] = run_workload(ref_side, scenario.without_aborts(), case.facts, label=PLAIN_LABEL,
                                       settings=scenario.settings.plain(), **on_ref)
        if own is not None:
            traces["plain-own"] = _own_dtype(run_workload(
                ref_side, scenario.without_aborts(), case.facts, label=PLAIN_LABEL,
                settings=scenario.settings.plain(), **own), case)
    plain = traces.get("plain-own", traces.get("plain"))
    if own_plain or (scenario.k and _differs(plain, traces["test"], scenario.aborted)):
        # spec-lossless fails: the engine under test without speculation says whether speculation is why
        traces["test-plain"] = traces["plain"] if same else run_workload(
            case.adapter_for(scenario), scenario.without_aborts(), case.facts, label=f"{label} with K=0",
            settings=scenario.settings.plain(), **where, tensor_parallel_size=case.tensor_parallel_size)
    if scenario.caching:
        traces["cached"] = traces["test"] if same else run_workload(
            cached_reference_adapter(), scenario, case.facts, label=CACHED_LABEL, **on_ref)
    if scenario.has_params:  # what each request's parameters must change ("params-change-output")
        traces["bare"] = run_workload(ref_side, scenario.without_params(), case.facts, label=BARE_LABEL,
                                      settings=scenario.settings.uncached(), **on_ref)
    return {k: v for k, v in traces.items() if k in ("plain", "plain-own", "test-plain", "cached", "bare")}


def _own_dtype(trace: Trace, case: Case) -> Trace:
    """A reference run in the engine's own dtype, named so in every report (the run itself, and the cache
    key, are the exact verdict's)."""
    trace.engine = f"{trace.engine} in {case.dtype} (the engine's own dtype)"
    return trace


def _differs(plain: Trace, test: Trace, aborted) -> bool:
    """Whether the engine under test's output differs from plain greedy output (aborted requests aside)."""
    if plain.error is not None or test.error is not None:
        return False
    for rid, want in plain.requests.items():
        got = test.requests.get(rid)
        if rid not in aborted and (got is None or (got.token_ids, got.finish_reason) != (want.token_ids,
                                                                                            want.finish_reason)):
            return True
    return False


def evaluate(scenario: Scenario, traces: dict[str, Trace], case: Case,
             scenario_file: str | None = None, fail_fast: bool = False, early: bool = False,
             only: str | None = None, scores: dict | None = None) -> list[CheckResult]:
    """Every check over ``traces``. ``fail_fast``: up to the first failing one; ``early``: only the checks
    that read neither the "plain" nor the "cached" run (a check's declaration says whether it is late);
    ``only``: that check alone. Under ``--verdict rescored`` the reference scores the engine's runs
    (``scores``: that scoring, when already made) and each check is judged as the verdict says
    (``checks.judge``)."""
    if case.judged.rescored and scores is None:
        from conformance.scoring import score_runs

        scores = score_runs(scenario, case, traces)
    inputs = checks.CheckInputs(
        scenario,
        traces["reference"],
        traces["test"],
        traces.get("plain"),
        case.facts.vocab_size,
        case.adapter.supports("batch_invariant"),
        not (case.allow_unexercised or case.drafter is not None),
        traces.get("cached"),
        traces.get("test-plain"),
        traces.get("bare"),
        verdict=case.judged,
        scores=scores,
        require_exercised=case.require_exercised,
    )
    own = None  # the bitwise checks' inputs where they are held to the reference in the engine's own dtype
    if case.judged.bitwise_in_own_dtype and "reference-own" in traces:
        own = replace(inputs, ref=traces["reference-own"], plain=traces.get("plain-own"),
                      verdict=case.judged.own_dtype())
    test = inputs.test
    results = []
    for c in checks.declared():
        if (early and c.late) or (only is not None and c.name != only):
            continue
        if test.error is not None and not c.runs_when_test_broke:
            results.append(CheckResult(c.name, NA, "the engine under test did not finish the workload"))
            continue
        lacks = c.lacking(test.missing_fields)
        if lacks:
            results.append(CheckResult(c.name, NA, f"the engine's records lack {', '.join(lacks)}"))
            continue
        result = checks.judge(c, inputs, own)
        if result.failed and result.request_id is not None and c.replay:
            result.details["replay"] = case.replay_command(scenario.id, result.request_id, scenario_file)
        results.append(result)
        if fail_fast and result.failed:
            break
    return results
