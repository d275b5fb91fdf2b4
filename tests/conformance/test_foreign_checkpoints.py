"""A healthy engine is green on checkpoints the suite was not tuned to: every trigger is forced on any model
(scripted drafts, constructed prompts, allowed ids) or declared as the model's (``Scenario.model_decides``),
when a miss is "not exercised", a warning with its reason; every bound holds or says the same.

The default tier holds the constructions to their proof (no model needed) and runs the forced n-gram request
on a transformers-written preset; the slow tests write checkpoints of each family with other dimensions,
layer patterns and seeds than the presets (``tests.helpers.checkpoints.FOREIGN``) and run the default tier
on them, with and without prefix caching: green on the reference and async engines, red with a mutant.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import itertools
import json
import re

import pytest
from filelock import FileLock

from conformance.checks import check_triggers
from conformance.checks.params import check_params_change_output, must_change
from conformance.cli import main as conformance_main
from conformance.harness import run_workload
from conformance.results import FAIL, NA, PASS
from conformance.trace import RequestTrace, Trace
from conformance.workloads import RequestSpec, Scenario, get_def, load_scenario, scenario_defs
from refengine.drafters.ngram import NgramDrafter
from tests.helpers.checkpoints import FOREIGN, write_foreign_checkpoint

# ---- the n-gram transitions, forced ------------------------------------------------------------------


FORCED = "params-ngram-k3"  # its last request is held to one id, the n-gram transitions forced


def _forced_walk(scenario: Scenario) -> list[tuple[int, int, int]]:
    """(committed tokens, drafts, accepted) per verify step of the forced request, whose every output is its
    one allowed id: the engines' lookup (refengine.drafters.ngram) over what it commits."""
    s, r = scenario.settings, scenario.requests[-1]
    (t,) = r.sampling["allowed_token_ids"]
    drafter = NgramDrafter(s.k, s.prompt_lookup_min, s.prompt_lookup_max, s.max_model_len)
    tokens, walk = [*r.prompt, t], []  # the prefill samples the first output
    while len(tokens) < min(s.max_model_len, len(r.prompt) + r.max_tokens):
        drafts = drafter.lookup(tokens)
        accepted = len(drafts) if all(d == t for d in drafts) else drafts.index(next(d for d in drafts
                                                                                     if d != t))
        walk.append((len(tokens), len(drafts), accepted))
        tokens += [t] * (accepted + 1)
    return walk


@pytest.mark.parametrize("vocab_size", [199, 256, 300, 320, 32768])
@pytest.mark.parametrize("tier", ["default", "nightly"])
def test_the_forced_ngram_request_accepts_drafts_then_verifies_none_on_any_model(vocab_size, tier):
    scenario = load_scenario(FORCED, tier, vocab_size)
    assert {"zero-draft-after-accept", "partial-drafts"} <= set(scenario.triggers) - set(
        dict(scenario.model_decides))  # forced, not the model's
    request = scenario.requests[-1]
    assert request.sampling["allowed_token_ids"][0] not in request.prompt
    walk = _forced_walk(scenario)
    after_accept = [b for a, b in itertools.pairwise(walk) if a[2] >= 1]
    assert any(drafts == 0 for _, drafts, _ in after_accept), walk  # zero-draft-after-accept
    assert any(0 < drafts < scenario.k for _, drafts, _ in walk), walk  # partial-drafts
    # the limit that ends its drafts never trims another request's: each stays K + 1 short of it
    longest = max(len(r.prompt) + r.max_tokens for r in scenario.requests[:-1])
    assert longest + scenario.k + 1 <= scenario.settings.max_model_len


def test_the_walk_sees_a_broken_construction():
    """One token more of prompt: the request reaches max_model_len in the step that would verify none."""
    scenario = load_scenario(FORCED, "default", 256)
    r = scenario.requests[-1]
    longer = dataclasses.replace(r, prompt=r.prompt + r.prompt[:1])
    walk = _forced_walk(dataclasses.replace(scenario, requests=(*scenario.requests[:-1], longer)))
    after_accept = [b for a, b in itertools.pairwise(walk) if a[2] >= 1]
    assert not any(drafts == 0 for _, drafts, _ in after_accept), walk


def test_the_forced_request_reaches_its_triggers_on_a_transformers_written_checkpoint(small_case):
    """Alone, on the Qwen3-Next preset transformers wrote (not the model the corpus is tuned to): the
    reference engine's run of it hits both triggers."""
    from conformance.adapters.refengine import reference_adapter

    full = load_scenario(FORCED, "default", small_case.facts.vocab_size)
    alone = dataclasses.replace(full, requests=(dataclasses.replace(full.requests[-1], arrival_step=0),),
                                triggers=("zero-draft-after-accept", "partial-drafts"), model_decides=())
    trace = run_workload(reference_adapter(), alone, small_case.facts, label="reference")
    check = check_triggers(alone, trace)
    assert check.status == PASS, check.summary


# ---- triggers the model decides --------------------------------------------------------------------


def test_every_declared_model_decided_trigger_is_one_of_the_scenarios_own_with_a_reason():
    for d in scenario_defs():
        for trigger, why in d.model_decides:
            assert trigger in d.triggers and len(why) > 20, (d.id, trigger, why)
    with pytest.raises(ValueError, match="model_decides entry"):
        dataclasses.replace(get_def("ngram-k1"), model_decides=(("preemption", "not its trigger"),))


@pytest.fixture(scope="module")
def ngram_traces(recorded_run):
    result, traces = recorded_run("ngram-k3")
    assert result.ok, result.checks
    return traces


def _without_zero_draft_steps(trace: Trace) -> Trace:
    """The trace as if the drafter always proposed something: zero-draft-after-accept is never hit."""
    always = copy.deepcopy(trace)
    for step in always.steps:
        for r in step.rows:
            if r.kind == "decode" and not r.draft_token_ids:
                r.draft_token_ids = [0]
    return always


def test_a_missed_trigger_fails_when_forced_and_warns_with_its_reason_when_the_model_decides(ngram_traces):
    decided = get_def("ngram-k3").materialize("default", 256)  # its transitions are the model's text's
    why = dict(decided.model_decides)["zero-draft-after-accept"]
    missed = _without_zero_draft_steps(ngram_traces["reference"])
    forced = check_triggers(dataclasses.replace(decided, model_decides=()), missed)
    assert forced.status == FAIL and forced.details["missed"] == ["zero-draft-after-accept"]

    gap = check_triggers(decided, missed)
    assert gap.status == NA and gap.details["not_exercised"] == ["zero-draft-after-accept"]
    assert why in gap.details["warning"] and decided.id in gap.details["warning"]
    asked = check_triggers(decided, missed, require_exercised=True)  # a gate asking for every trigger
    assert asked.status == FAIL and why in asked.report
    assert check_triggers(decided, ngram_traces["reference"], require_exercised=True).status == PASS


# ---- params-change-output: a parameter that must matter, and one the model decides ---------------------


def _request(tokens, finish="length", stop_reason=None, text=None) -> RequestTrace:
    return RequestTrace("r00", [5, 6, 7], list(tokens), finish, [], text=text, stop_reason=stop_reason)


@pytest.mark.parametrize("params,bare,must", [
    ({"allowed_token_ids": [3, 4]}, _request([3, 9, 4]), "id 9 at position 1, outside allowed_token_ids"),
    ({"allowed_token_ids": [3, 4]}, _request([3, 4, 4]), None),  # its output was allowed anyway
    ({"min_tokens": 3}, _request([3, 8], "stop", 8), "stops on an id after 2 tokens"),
    ({"min_tokens": 2}, _request([3, 4, 8], "stop", 8), None),  # it stopped after min_tokens anyway
    ({"stop": ["ab"]}, _request([1, 2, 3], text="xaby"), "holds its stop string 'ab'"),
    ({"stop": ["ab"]}, _request([1, 2, 3], text="xyz"), None),
    ({"stop": ["ab"], "min_tokens": 4}, _request([1, 2, 3], text="xaby"), None),  # min_tokens holds it
    ({"presence_penalty": 1.5}, _request([3, 3, 3]), None),  # whether it moves an argmax is the model's
])
def test_must_change_says_where_the_parameters_matter_on_any_model(params, bare, must):
    why = must_change(RequestSpec("r00", (5, 6, 7), 3, params=params), bare)
    assert (why is None) if must is None else (must in why), why


def _params_run(params: dict, tokens: list[int]) -> tuple[Scenario, Trace, Trace]:
    """A scenario of one restricted request whose output is ``tokens`` with its parameters and without."""
    spec = RequestSpec("r00", (5, 6, 7), len(tokens), params=params)
    scenario = Scenario("one-request", "", "default", get_def("ngram-k1").settings, (spec,))
    ref, bare = Trace("reference", scenario.id), Trace("reference", scenario.id)
    ref.requests["r00"], bare.requests["r00"] = _request(tokens), _request(tokens)
    return scenario, ref, bare


def test_parameters_that_changed_nothing_fail_where_they_must_matter_and_warn_where_the_model_decides():
    ignored = check_params_change_output(*_params_run({"allowed_token_ids": [3]}, [3, 9]))
    assert ignored.status == FAIL and "its parameters were ignored" in ignored.summary, ignored.summary
    penalty = check_params_change_output(*_params_run({"presence_penalty": 1.5}, [3, 9]))
    assert penalty.status == NA and penalty.details["not_exercised"] == ["r00"], penalty.summary
    assert "a penalty or a bias moves an argmax only where the logits are close" in penalty.details["warning"]
    run = _params_run({"presence_penalty": 1.5}, [3, 9])
    asked = check_params_change_output(*run, require_exercised=True)
    assert asked.status == FAIL and "changed nothing" in asked.summary


# ---- the default tier on checkpoints a user brings (slow) -----------------------------------------------


@pytest.fixture(scope="session")
def foreign_checkpoint(shared_dir):
    """``get(name) -> folder``: a checkpoint of ``FOREIGN``, written once per test run."""

    def get(name: str) -> str:
        root = shared_dir / f"foreign-{re.sub(r'[^a-z0-9-]', '_', name)}"
        with FileLock(str(root) + ".lock"):
            if not (root / "model" / "foreign_spec.json").is_file():
                write_foreign_checkpoint(root, name)
        return str(root / "model")

    return get


def _run(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = conformance_main(["run", *args], out=out)
    return code, out.getvalue()


def _failed(text: str) -> list[str]:
    return re.findall(r"^\s*FAILED ([\w.@-]+): ", text, re.MULTILINE)


@pytest.mark.slow
@pytest.mark.parametrize("caching", [[], ["--enable-prefix-caching"]], ids=["plain", "prefix-caching"])
@pytest.mark.parametrize("engine", ["reference", "async"])
@pytest.mark.parametrize("name", FOREIGN)
def test_the_default_tier_is_green_on_a_foreign_checkpoint(name, engine, caching, foreign_checkpoint):
    code, text = _run("--engine", engine, "--model", foreign_checkpoint(name), *caching)
    assert code == 0 and not _failed(text), text
    skipped = re.findall(r"^\[\s*\d+/\d+\] SKIP\s+\S+\s+\[(.*)\]", text, re.MULTILINE)
    assert all("no MTP head" in why for why in skipped), skipped  # the dense family has none


# The mutant each family's checkpoint must catch with n-gram drafts: a zero-draft row after accepted drafts
# reading the state of slot 0 (the recurrent families: vLLM #52942), a decode row verifying the host's K
# draft positions, fillers included (the dense family: it keeps no recurrent state).
FAMILY_MUTANT = {"nemotron-h-m*em-e": ("zero-draft-reads-first-slot", FORCED),
                 "qwen35-lllfl": ("zero-draft-reads-first-slot", FORCED),
                 "qwen3-dense-6x3": ("drafts-counted-from-host", "ngram-k3")}


@pytest.mark.slow
@pytest.mark.parametrize("name", FOREIGN)
def test_a_shipped_mutant_is_red_on_a_foreign_checkpoint(name, foreign_checkpoint):
    mutant, scenario = FAMILY_MUTANT[name]
    model = foreign_checkpoint(name)
    code, text = _run("--engine", f"mutant:{mutant}", "--model", model, "--scenario", scenario)
    assert code == 1 and _failed(text) == [scenario], text


# ---- the workloads do not import the checks (one direction) --------------------------------------------


def test_the_workloads_never_import_the_checks():
    """The trigger modules import the workloads (``Scenario``); the workloads name no module of the checks,
    lazily or not: a scenario file's unknown trigger is refused where the run is put together."""
    import ast
    from pathlib import Path

    import conformance.workloads

    wrong = []
    for path in sorted(Path(conformance.workloads.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            wrong += [f"{path.name} imports {n}" for n in names if n.startswith("conformance.checks")]
    assert not wrong, wrong


def test_a_scenario_files_trigger_that_is_no_name_is_refused_with_the_file(tmp_path):
    from conformance.workloads.files import ScenarioFileError, read_scenario_file, write_scenario_file

    scenario = load_scenario("short-prompts-k0", "default", 256)
    path = write_scenario_file(tmp_path / "s.json", scenario, 256)
    data = json.loads(path.read_text())
    data["triggers"] = [3]
    path.write_text(json.dumps(data))
    with pytest.raises(ScenarioFileError, match=r"s\.json: triggers: a trigger is a non-empty name, got 3"):
        read_scenario_file(path)
