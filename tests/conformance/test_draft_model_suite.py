"""The suite's draft-model settings: scenario validation, the run-wide ``--drafter`` / ``--draft-model``
override, and the default-tier scenario's place in the corpus (its run and its mutants: test_mutants.py)."""

from __future__ import annotations

import pytest

from conformance import cli, session
from conformance.harness import Case
from conformance.workloads import EngineSettings, get_def, scenario_ids


def test_a_draft_model_scenario_names_its_checkpoint():
    assert EngineSettings(num_speculative_tokens=3, drafter="draft_model", draft_model="cut:0,3").draft_model
    with pytest.raises(ValueError, match="goes with drafter 'draft_model'"):
        EngineSettings(num_speculative_tokens=3, drafter="draft_model")
    with pytest.raises(ValueError, match="goes with drafter 'draft_model'"):
        EngineSettings(num_speculative_tokens=3, draft_model="cut:2")
    plain = EngineSettings(num_speculative_tokens=3, drafter="draft_model", draft_model="cut:2").plain()
    assert (plain.k, plain.drafter, plain.draft_model) == (0, "mtp", None)
    assert "draft-model-k3" in scenario_ids("default")


def _case(**kw) -> Case:
    return Case("async", None, None, None, **kw)


def test_the_run_wide_drafter_replaces_every_speculating_scenarios_own():
    case = _case(drafter="draft_model", draft_model="cut:0,3")
    scripted = case.apply(get_def("scripted-ragged-k3").materialize("default", 260))
    assert (scripted.settings.drafter, scripted.settings.draft_model, scripted.settings.pattern) == (
        "draft_model", "cut:0,3", "hash")
    plain = case.apply(get_def("short-prompts-k0").materialize("default", 260))
    assert plain.settings.drafter == "mtp" and plain.settings.draft_model is None
    ngram = _case(drafter="ngram").apply(get_def("draft-model-k3").materialize("default", 260))
    assert (ngram.settings.drafter, ngram.settings.draft_model) == ("ngram", None)
    assert "--drafter draft_model --draft-model cut:0,3" in case.replay_command("mtp-k3")
    assert _case().apply(get_def("mtp-k3").materialize("default", 260)).settings.drafter == "mtp"


def test_the_command_line_takes_the_drafter_and_refuses_a_draft_model_without_it():
    args = cli.build_parser().parse_args(["run", "--drafter", "draft_model", "--draft-model", "cut:1"])
    sel = cli._selection(args)
    assert (sel.drafter, sel.draft_model) == ("draft_model", "cut:1")
    with pytest.raises(ValueError, match="--draft-model goes with --drafter draft_model"):
        session.Selection(draft_model="cut:1")
    with pytest.raises(ValueError, match="--draft-model goes with --drafter draft_model"):
        _case(drafter="draft_model")
