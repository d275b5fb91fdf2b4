"""Run a scenario through the reference engine and the engine under test, then check the traces."""

from __future__ import annotations

import shlex
import time
import traceback
from dataclasses import dataclass

from conformance import checks
from conformance.engines import EngineAdapter, RunSpec, reference_adapter
from conformance.model import ModelFacts
from conformance.results import NA, CheckResult, ScenarioResult
from conformance.trace import Recorder, Trace
from conformance.workloads import EngineSettings, Scenario, get_def, seed_of

REFERENCE_LABEL = "reference"
PLAIN_LABEL = "plain greedy (K=0)"


class NoProgress(RuntimeError):
    pass


def run_workload(adapter: EngineAdapter, scenario: Scenario, facts: ModelFacts, *, label: str,
                 settings: EngineSettings | None = None, device: str = "cpu") -> Trace:
    """Feed the scenario's requests at their arrival steps and record everything the engine reports.

    An exception from the engine ends the run; it is recorded in ``trace.error`` (the "runs" check
    reports it) rather than raised.
    """
    import torch

    from refengine import SamplingParams

    settings = settings or scenario.settings
    recorder = Recorder(label, scenario.id)
    torch.manual_seed(seed_of(scenario.id) % (1 << 31))
    pending = sorted(scenario.requests, key=lambda r: (r.arrival_step, r.request_id))
    limit = 1000 + 20 * sum(len(r.prompt) + r.max_tokens for r in scenario.requests)
    step = nxt = 0
    try:
        engine = adapter.start(RunSpec(facts.path, settings, facts.vocab_size, recorder.on_step, device))
        while nxt < len(pending) or engine.has_unfinished():
            if not engine.has_unfinished() and pending[nxt].arrival_step > step:
                step = pending[nxt].arrival_step  # idle until the next arrival
            while nxt < len(pending) and pending[nxt].arrival_step <= step:
                r = pending[nxt]
                prompt = r.prompt if isinstance(r.prompt, str) else list(r.prompt)
                engine.add_request(r.request_id, prompt, SamplingParams(r.max_tokens, r.ignore_eos, r.stop_token_ids))
                nxt += 1
            for out in engine.step():
                recorder.on_output(out)
            step += 1
            if step > limit:
                raise NoProgress(f"no completion after {limit} steps")
        recorder.trace.pools_empty = engine.pools_empty() if adapter.supports("pools") else None
    except Exception:  # noqa: BLE001 - the engine under test may fail in any way; the report shows how
        recorder.trace.error = traceback.format_exc()
    recorder.trace.num_engine_steps = step
    return recorder.finish(settings.k > 0)


@dataclass(frozen=True)
class Case:
    """Everything one scenario run needs besides the scenario itself."""

    engine: str  # the selection as given: "async", "reference", "pkg.mod:factory"
    adapter: EngineAdapter
    facts: ModelFacts
    model_arg: str | None  # what the user passed as --model (None: embedded default)
    tier: str = "default"
    device: str = "cpu"

    def replay_command(self, scenario_id: str, request_id: str | None = None) -> str:
        cmd = ["conformance", "replay", scenario_id]
        if request_id is not None:
            cmd += ["--request", request_id]
        cmd += ["--engine", self.engine, "--tier", self.tier]
        if self.model_arg is not None:
            cmd += ["--model", self.facts.path]
        if self.device != "cpu":
            cmd += ["--device", self.device]
        return shlex.join(cmd)


def skip_reason(scenario: Scenario, case: Case) -> str | None:
    s, facts = scenario.settings, case.facts
    if s.k and s.drafter == "mtp" and not facts.has_mtp:
        return "the model has no MTP head (mtp.* weights)"
    if s.k and not case.adapter.supports("mtp" if s.drafter == "mtp" else "scripted_drafter"):
        return f"the engine under test does not support the {s.drafter} drafter"
    if any(isinstance(r.prompt, str) for r in scenario.requests) and not facts.has_tokenizer:
        return "text prompts need a model with a tokenizer"
    return None


def run_scenario(scenario_id: str, case: Case) -> tuple[ScenarioResult, dict[str, Trace]]:
    """Run one scenario; returns its result and the traces ("reference", "test", maybe "plain")."""
    start = time.perf_counter()
    scenario = get_def(scenario_id).materialize(case.tier, case.facts.vocab_size)
    result = ScenarioResult(scenario.id, scenario.description, case.tier, case.engine, case.facts.label,
                            scenario.settings.describe(), replay=case.replay_command(scenario.id))
    traces: dict[str, Trace] = {}
    result.skipped = skip_reason(scenario, case)
    if result.skipped is None:
        ref_side = reference_adapter()
        traces["reference"] = run_workload(ref_side, scenario, case.facts, label=REFERENCE_LABEL, device=case.device)
        if traces["reference"].error is not None:
            result.error = "the reference engine failed on this workload:\n" + traces["reference"].error
        else:
            label = "reference (under test)" if case.engine == "reference" else case.engine
            traces["test"] = run_workload(case.adapter, scenario, case.facts, label=label, device=case.device)
            if scenario.k:
                traces["plain"] = run_workload(ref_side, scenario, case.facts, label=PLAIN_LABEL,
                                               settings=scenario.settings.plain(), device=case.device)
            result.checks = evaluate(scenario, traces, case)
    result.duration_s = time.perf_counter() - start
    return result, traces


def evaluate(scenario: Scenario, traces: dict[str, Trace], case: Case) -> list[CheckResult]:
    ref, test, plain = traces["reference"], traces["test"], traces.get("plain")
    batch_invariant = case.adapter.supports("batch_invariant")
    runs = [
        ("runs", lambda: checks.check_runs(test, [r.request_id for r in scenario.requests])),
        ("tokens", lambda: checks.check_tokens(ref, test)),
        ("acceptance", lambda: checks.check_acceptance(ref, test)),
        ("logits-digests", lambda: checks.check_logits_digests(ref, test) if batch_invariant
         else CheckResult("logits-digests", NA, "the engine under test is not batch-invariant")),
        ("spec-lossless", lambda: checks.check_spec_lossless(plain, test)),
        ("full-graph-metadata", lambda: checks.check_full_graph_metadata(test)),
        ("new-prompt-prefill", lambda: checks.check_new_prompt_prefill(test)),
        ("id-range", lambda: checks.check_id_range(test, case.facts.vocab_size)),
        ("state-slots", lambda: checks.check_state_slots(test)),
        ("pools-empty", lambda: checks.check_pools_empty(test)),
        ("workload-triggers", lambda: checks.check_triggers(scenario, ref)),
    ]
    results = []
    for name, fn in runs:
        if test.error is not None and name not in ("runs", "workload-triggers"):
            results.append(CheckResult(name, NA, "the engine under test did not finish the workload"))
            continue
        result = fn()
        if result.failed and result.request_id is not None and name != "workload-triggers":
            result.details["replay"] = case.replay_command(scenario.id, result.request_id)
        results.append(result)
    return results
