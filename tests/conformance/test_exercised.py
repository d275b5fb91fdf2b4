"""Issue #48, item 1: every trigger and every bound holds on a checkpoint, or is reported as *not exercised*
with its reason (a warning and a named gap of the text summary and the JSON report), failing only under the
gate that asks for it (``--require-exercised`` / ``--conformance-require-exercised``; ci/nightly.py passes it
on the presets). A scenario that cannot apply on a checkpoint (a ``cut:0,3`` draft model of a model of fewer
than four layers, structured outputs on a model without an EOS token) is skipped with the reason instead of
breaking, and ``conformance fuzz`` never counts a drawn parameter that changed nothing as a failure."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conformance import plugin, runner
from conformance.checks import check_triggers
from conformance.checks.params import check_params_change_output
from conformance.checks.triggers import UNFORCED
from conformance.harness import skip_reason
from conformance.model import ModelFacts, describe_model
from conformance.report_files import build_json
from conformance.report_text import format_summary
from conformance.results import FAIL, NA, CheckResult, ScenarioResult
from conformance.session import Selection
from conformance.trace import RequestTrace, Trace
from conformance.workloads import EngineSettings, RequestSpec, Scenario, load_scenario
from tests.conformance.test_cli import run_cli

REPO = Path(__file__).resolve().parents[2]
WHY = "whether this one is reached is the checkpoint's own text, which another model spells otherwise"


def _missed(model_decides: bool) -> tuple[Scenario, Trace]:
    """A scenario whose point is preemption and a reference run that never preempted (no step at all)."""
    scenario = Scenario("misses-preemption", "", "default", EngineSettings(),
                        (RequestSpec("r00", (1, 2, 3), 2),), ("preemption",),
                        model_decides=(("preemption", WHY),) if model_decides else ())
    return scenario, Trace("reference", scenario.id)


# ---- the checks: a gap without the gate, a failure with it --------------------------------------------


def test_a_model_decided_miss_is_a_named_gap_and_fails_only_under_require_exercised():
    scenario, trace = _missed(model_decides=True)
    gap = check_triggers(scenario, trace)
    assert gap.status == NA and gap.details["gaps"] == [{"what": "trigger preemption", "why": WHY}]
    asked = check_triggers(scenario, trace, require_exercised=True)
    assert asked.status == FAIL and WHY in asked.report and "--require-exercised" in asked.report


def test_require_exercised_fails_a_miss_that_the_run_otherwise_lets_warn():
    """Not strict (--allow-unexercised, --drafter): a forced miss is a gap, unless the gate asks for all."""
    scenario, trace = _missed(model_decides=False)
    gap = check_triggers(scenario, trace, strict=False)
    assert gap.status == NA and gap.details["gaps"] == [{"what": "trigger preemption", "why": UNFORCED}]
    assert check_triggers(scenario, trace, strict=False, require_exercised=True).status == FAIL


def _params_run(params: dict) -> tuple[Scenario, Trace, Trace]:
    spec = RequestSpec("r00", (5, 6, 7), 2, params=params)
    scenario = Scenario("one-request", "", "default", EngineSettings(), (spec,))
    ref, bare = Trace("reference", scenario.id), Trace("reference", scenario.id)
    ref.requests["r00"] = bare.requests["r00"] = RequestTrace("r00", [5, 6, 7], [3, 9], "length", [])
    return scenario, ref, bare


def test_parameters_that_changed_nothing_on_this_model_are_a_named_gap():
    gap = check_params_change_output(*_params_run({"presence_penalty": 1.5}))
    assert gap.status == NA
    (named,) = gap.details["gaps"]
    assert named["what"] == "request r00's parameters (presence_penalty)"
    assert "a penalty or a bias moves an argmax only where the logits are close" in named["why"]
    asked = check_params_change_output(*_params_run({"presence_penalty": 1.5}), require_exercised=True)
    assert asked.status == FAIL and "--require-exercised" in asked.summary


# ---- the named gaps in the text summary and the JSON report -------------------------------------------


def _results() -> list[ScenarioResult]:
    scenario, trace = _missed(model_decides=True)
    gap = ScenarioResult("misses-preemption", "", "default", "async", "m", "K=0",
                         [CheckResult("runs", "pass", "ok"), check_triggers(scenario, trace),
                          check_params_change_output(*_params_run({"presence_penalty": 1.5}))])
    clean = ScenarioResult("clean", "", "default", "async", "m", "K=0", [CheckResult("runs", "pass", "ok")])
    return [gap, clean]


def test_the_text_summary_names_each_gap_with_its_scenario_and_reason():
    text = format_summary(_results(), 1.0)
    assert "not exercised: 2 gap(s) in 1 scenario(s)" in text
    assert f"  not exercised: misses-preemption: trigger preemption ({WHY})" in text
    assert "  not exercised: misses-preemption: request r00's parameters (presence_penalty) (a pen" in text
    assert "not exercised" not in format_summary(_results()[1:], 1.0)  # no gap, no line


def test_the_json_report_lists_the_gaps_and_survives_its_round_trip():
    results = [ScenarioResult.from_dict(json.loads(json.dumps(r.to_dict()))) for r in _results()]
    report = build_json(results, engine="async", tier="default", model="m", environment={}, elapsed=1.0)
    assert report["summary"]["not_exercised"] == 2
    assert report["not_exercised"][0] == {"scenario": "misses-preemption", "check": "workload-triggers",
                                          "what": "trigger preemption", "why": WHY}
    assert report["not_exercised"][1]["check"] == "params-change-output"
    assert report["gate"]["require_exercised"] is False


def test_a_result_written_before_the_gaps_were_named_still_lists_them():
    old = CheckResult("workload-triggers", NA, "not exercised on this model: preemption",
                      details={"not_exercised": ["preemption"], "reasons": {"preemption": WHY}})
    result = ScenarioResult("s", "", "default", "async", "m", "K=0", [old])
    assert result.gaps == [{"check": "workload-triggers", "what": "preemption", "why": WHY}]


# ---- the gate option: CLI, plugin, runner, nightly -------------------------------------------------------


def test_the_run_carries_require_exercised_to_the_suite_and_says_it_up_front():
    assert "--conformance-require-exercised" in runner.suite_args(Selection(require_exercised=True))
    assert "--conformance-require-exercised" not in runner.suite_args(Selection())
    assert "(--require-exercised)" in runner.gate_note(require_exercised=True)
    assert "named gap" in runner.gate_note()  # without it: what a model-decided miss is


def test_require_and_allow_unexercised_together_are_refused():
    with pytest.raises(ValueError, match="give one of them"):
        Selection(require_exercised=True, allow_unexercised=True)
    code, _ = run_cli("run", "--require-exercised", "--allow-unexercised")
    assert code == 2


def _config(**options):
    values = {"conformance_threads": 1, "conformance_step_timeout": 600.0, "conformance_min_scenarios": 0,
              "conformance_require_feature": [], "conformance_fail_on_skip": False,
              "conformance_allow_unexercised": False, "conformance_require_exercised": False, **options}
    return SimpleNamespace(getoption=lambda name: values.get(name))


def test_the_plugin_takes_require_exercised_into_its_gate_and_reports():
    on = _config(conformance_require_exercised=True)
    assert run_meta_gate(on)["require_exercised"] is True
    assert run_meta_gate(_config())["require_exercised"] is False
    assert "(--require-exercised)" in plugin._gate_description(on)
    both = _config(conformance_require_exercised=True, conformance_allow_unexercised=True)
    with pytest.raises(pytest.UsageError, match="give one of them"):
        plugin._check_options(both)


def run_meta_gate(config) -> dict:
    return plugin.run_meta(config)["gate"]


def test_the_plugin_declares_the_option():
    declared = {}

    class Group:
        def addoption(self, *names, **kwargs):
            declared.update({n: kwargs for n in names})

    plugin.pytest_addoption(SimpleNamespace(getgroup=lambda *a, **k: Group()))
    assert declared["--conformance-require-exercised"]["action"] == "store_true"


def test_the_nightly_requires_every_trigger_on_the_presets_only(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "ci"))
    monkeypatch.delitem(sys.modules, "nightly", raising=False)
    import nightly

    monkeypatch.delenv("CONFORMANCE_MODEL", raising=False)
    args = nightly.build_parser().parse_args

    def opts(*argv):
        return nightly.suite_options(args(list(argv)))

    assert "--conformance-require-exercised" in opts()  # the embedded default model
    assert "--conformance-require-exercised" in opts("--model", "tiny:nemotron_h")
    assert "--conformance-require-exercised" not in opts("--model", "/ckpt")  # a user's checkpoint
    monkeypatch.setenv("CONFORMANCE_MODEL", "/ckpt")
    assert "--conformance-require-exercised" not in opts()


def test_a_forced_miss_under_allow_unexercised_is_named_in_the_summary_and_fails_with_the_gate(
        tiny_checkpoint, tmp_path):
    from tests.conformance.test_power import _missing_a_trigger

    path = str(_missing_a_trigger(tmp_path))
    argv = ("run", "--engine", "reference", "--model", tiny_checkpoint, "--scenario-file", path)
    code, out = run_cli(*argv, "--allow-unexercised", "--report-json", str(tmp_path / "r.json"))
    assert code == 0 and f"  not exercised: misses-preemption: trigger preemption ({UNFORCED})" in out, out
    report = json.loads((tmp_path / "r.json").read_text())
    assert [g["what"] for g in report["not_exercised"]] == ["trigger preemption"]
    code, out = run_cli(*argv, "--require-exercised", "--report-json", str(tmp_path / "g.json"))
    assert code == 1 and "--require-exercised" in out, out
    assert json.loads((tmp_path / "g.json").read_text())["gate"]["require_exercised"] is True


# ---- scenarios a checkpoint cannot run: skipped with the reason -------------------------------------------


def _case(num_layers: int = 4, eos=(2,)):
    facts = ModelFacts("/x", "x", 256, tuple(eos), True, True, "qwen3_next", num_layers)
    return SimpleNamespace(facts=facts, adapter=SimpleNamespace(supports=lambda feature: True))


def test_a_layer_cut_the_checkpoint_lacks_skips_its_scenario_with_the_reason():
    scenario = load_scenario("draft-model-k3", "default", 256)  # cut:0,3
    assert skip_reason(scenario, _case(4)) is None
    why = skip_reason(scenario, _case(3))
    assert why == "its draft model cut:0,3 keeps layers a model of 3 layers does not have", why
    whole = dataclasses.replace(scenario,
                                settings=dataclasses.replace(scenario.settings, draft_model="cut:all"))
    assert skip_reason(whole, _case(1)) is None
    assert skip_reason(scenario, _case(0)) is None  # a layer count not known: the run says what breaks


def test_structured_outputs_on_a_model_without_eos_skip_with_the_reason():
    scenario = load_scenario("structured-scripted-k3", "default", 256)
    assert skip_reason(scenario, _case(eos=(2,))) is None
    assert "need a model with an EOS token" in skip_reason(scenario, _case(eos=()))
    assert skip_reason(load_scenario("short-prompts-k0", "default", 256), _case(eos=())) is None


def test_the_facts_count_the_checkpoints_layers(tiny_checkpoint):
    assert describe_model(tiny_checkpoint).num_layers == 4


def test_a_three_layer_checkpoint_without_eos_skips_those_scenarios_and_is_green(tiny_checkpoint, tmp_path):
    """End to end: before, both scenarios broke the reference run (an infrastructure error each)."""
    from refengine.tools.draft_model import make_draft_model
    from refengine.tools.tiny_models import _write_tokenizer

    model = make_draft_model(tiny_checkpoint, tmp_path / "three", "3")  # no eos_token_id, as the preset
    _write_tokenizer(model, describe_model(str(model)).vocab_size)
    code, out = run_cli("run", "--engine", "reference", "--model", str(model), "--scenario", "draft-model-k3",
                        "--scenario", "structured-ngram-k3", "--scenario", "short-prompts-k0")
    assert code == 0 and "PASS  short-prompts-k0" in out, out
    assert "SKIP  draft-model-k3  [its draft model cut:0,3 keeps layers a model of 3 layers" in out, out
    assert "SKIP  structured-ngram-k3  [structured outputs need a model with an EOS token" in out, out


# ---- conformance fuzz: a drawn parameter that changed nothing is no failure --------------------------------


def test_fuzz_judges_without_the_gate_and_counts_every_failing_check(monkeypatch, tmp_path):
    """A generated workload's drawn parameters may change nothing on the checkpoint (a gap, never a failure
    to shrink): fuzz judges with --require-exercised off, so the one params-change-output failure left is a
    parameter that must have mattered on any model, and it counts (no message filter drops it)."""
    from conformance import fuzz
    from conformance.adapters.refengine import reference_adapter
    from conformance.harness import Case

    facts = ModelFacts("/x", "x", 256, (2,), False, False, "qwen3_next", 4)
    case = Case("reference", reference_adapter(), facts, None, require_exercised=True)
    seen, judged = [], []
    ignored = CheckResult("params-change-output", FAIL, "request r00: its parameters changed nothing, ...")

    def run_scenario(scenario, c, **kwargs):
        seen.append(c.require_exercised)
        return ScenarioResult(scenario.id, "", "default", "reference", "x", "", [ignored]), {}

    def explore(strategy, judge, **kwargs):
        judged.append(judge(_missed(False)[0], None)[0])
        return fuzz.Search(examples=1)

    monkeypatch.setattr(fuzz, "run_scenario", run_scenario)
    monkeypatch.setattr(fuzz, "explore", explore)
    fuzz.fuzz(case, out_dir=tmp_path, aborts=False, caching=False, shrink=False)
    assert seen == [False] and judged == [("params-change-output",)]
