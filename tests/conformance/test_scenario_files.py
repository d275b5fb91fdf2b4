"""Scenario files are validated like API input, before any work: every key's type and range, token ids
inside the vocabulary, unknown keys named with a suggestion (one line, exit status 2); a file's scenario
never takes a corpus scenario's id; a run that checked nothing is never green."""

from __future__ import annotations

import copy
import json
from dataclasses import fields

import pytest

from conformance.plugin import gate_failures
from conformance.results import ScenarioResult
from conformance.workloads import EngineSettings, RequestSpec, file_scenario
from conformance.workloads.files import FILE_RULES, REQUEST_RULES, SETTINGS_RULES, scenario_to_dict
from conformance.workloads.scenario import Scenario
from tests.conformance.test_cli import run_cli
from tests.conformance.test_refused_up_front import no_run  # noqa: F401 - a fixture

GOOD = scenario_to_dict(Scenario("my-file", "", "default", EngineSettings(num_speculative_tokens=1),
                                 (RequestSpec("r00", (5, 6, 7), 4),)), 260)


def _request(**change):
    def edit(d):
        d["requests"][0].update(change)
    return edit


def _typo(d):
    d["requests"][0]["max_token"] = d["requests"][0].pop("max_tokens")


BAD = {
    "id outside the vocabulary": (_request(prompt=[5, 999]), ("requests[0] (r00).prompt must hold token ids "
                                  "in [0, 260) (the file's vocab_size); 999 is outside")),
    "negative id": (_request(stop_token_ids=[-1]), "requests[0] (r00).stop_token_ids must hold token ids"),
    "max_tokens -1": (_request(max_tokens=-1),
                      "requests[0] (r00).max_tokens must be an integer >= 1, got -1"),
    "empty prompt": (_request(prompt=[]), "requests[0] (r00).prompt must not be empty"),
    "empty text": (_request(prompt=" "), "requests[0] (r00).prompt must be a non-empty text"),
    "misspelt key": (_typo, "requests[0] (r00): unknown key 'max_token' (did you mean 'max_tokens'?)"),
    "a float": (_request(arrival_step=1.5),
                "requests[0] (r00).arrival_step must be an integer >= 0, got 1.5"),
    "a string for an int": (lambda d: d["settings"].update(block_size="16"),
                            "settings.block_size must be an integer >= 1, got \"16\""),
    "misspelt setting": (lambda d: d["settings"].update(max_num_seq=2),
                         "settings: unknown key 'max_num_seq' (did you mean 'max_num_seqs'?)"),
    "unknown drafter": (lambda d: d["settings"].update(drafter="medusa"),
                        "settings.drafter must be one of mtp, "),
    "bool for an int": (_request(max_tokens=True), "requests[0] (r00).max_tokens must be an integer >= 1"),
    "no requests": (lambda d: d.update(requests=[]), "requests must be a non-empty list"),
    "missing vocab_size": (lambda d: d.pop("vocab_size"), "missing required key 'vocab_size'"),
    "params id outside the vocabulary": (_request(params={"logit_bias": {"999": 1.0}}),
                                         "requests[0] (r00).params: token id 999 is outside [0, 260)"),
    "misspelt param": (_request(params={"min_tokn": 2}),
                       "requests[0] (r00).params: unknown key 'min_tokn' (did you mean 'min_tokens'?)"),
    "param out of range": (_request(params={"presence_penalty": 9}),
                           "requests[0] (r00).params: presence_penalty must be in [-2, 2], got 9"),
    "top_p out of range": (_request(params={"temperature": 0.8, "top_p": 0}),
                           "requests[0] (r00).params: top_p must be in (0, 1], got 0"),
    "negative temperature": (_request(params={"temperature": -1}),
                             "requests[0] (r00).params: temperature must be a finite number >= 0, got -1"),
    "unknown trigger": (lambda d: d.update(triggers=["preemptoin"]),
                        "triggers: unknown trigger 'preemptoin' (did you mean 'preemption'?)"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("command", ["run", "replay"])
def test_a_bad_value_is_one_line_naming_the_key_before_any_work(case, command, tmp_path, capsys, no_run):  # noqa: F811
    edit, message = BAD[case]
    data = copy.deepcopy(GOOD)
    edit(data)
    f = tmp_path / "s.json"
    f.write_text(json.dumps(data))
    code, _ = run_cli(command, "--engine", "reference", "--scenario-file", str(f))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(f"conformance {command}: {f}: ") and message in err[0], err[0]


def test_the_rules_cover_every_field_of_the_dataclasses():
    """A field added to EngineSettings or RequestSpec (a sampling parameter, say) needs its rule."""
    assert set(SETTINGS_RULES) == {f.name for f in fields(EngineSettings)}
    assert set(REQUEST_RULES) == {f.name for f in fields(RequestSpec)}
    assert set(GOOD) <= set(FILE_RULES)


def test_a_file_reusing_a_corpus_id_is_named_as_the_file(tmp_path):
    data = dict(GOOD, id="short-prompts-k1")
    f = tmp_path / "mine.json"
    f.write_text(json.dumps(data))
    scenario = file_scenario(f, 260, "default")
    assert scenario.id == "short-prompts-k1@mine.json" and str(f) in scenario.description
    (tmp_path / "own.json").write_text(json.dumps(GOOD))
    assert file_scenario(tmp_path / "own.json", 260, "default").id == "my-file"


def test_a_run_where_every_scenario_skipped_is_not_green():
    skipped = ScenarioResult("a", "", "default", "reference", "m", "")
    skipped.skipped = "text prompts need a model with a tokenizer"
    assert gate_failures([skipped], 0) == ["no scenario ran: all 1 were skipped, so nothing was checked"]
    ran = ScenarioResult("b", "", "default", "reference", "m", "")
    assert gate_failures([skipped, ran], 0) == []
