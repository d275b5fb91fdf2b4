"""The structured-outputs check fails on outputs outside their grammar (judged without xgrammar), in either
run (the suite's own run, tests/conformance/test_suite.py, passes it on the structured-* scenarios)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conformance.checks import check_structured_outputs
from conformance.results import FAIL, NA, PASS
from conformance.trace import RequestTrace
from conformance.workloads.scenario import RequestSpec

SCHEMA = {"type": "object", "required": ["a"], "properties": {"a": {"enum": ["cat", "owl"]}}}
SPECS = [
    RequestSpec("j", (1, 2), 30, params={"structured_outputs": {"json": SCHEMA}}),
    RequestSpec("r", (1, 2), 30, params={"structured_outputs": {"regex": "[a-c]{2,5}x"}}),
    RequestSpec("c", (1, 2), 30, params={"structured_outputs": {"choice": ["yes", "no"]}}),
    RequestSpec("u", (1, 2), 30),
]
GOOD = {"j": '{"a": "owl"}', "r": "abcx", "c": "no", "u": "anything"}


def _trace(engine: str, texts: dict, reasons: dict | None = None):
    reasons = reasons or {}
    return SimpleNamespace(engine=engine, requests={
        rid: RequestTrace(rid, [1, 2], [0] * len(text), reasons.get(rid, "stop"), [], text=text)
        for rid, text in texts.items()})


def _check(ref_texts, test_texts, reasons=None):
    scenario = SimpleNamespace(requests=SPECS)
    return check_structured_outputs(scenario, _trace("reference", ref_texts, reasons),
                                    _trace("async", test_texts, reasons))


def test_outputs_in_their_grammar_pass():
    assert _check(GOOD, GOOD).status == PASS


@pytest.mark.parametrize("rid,text,why", [
    ("j", '{"a": "dog"}', "does not match its JSON schema"),
    ("j", '{"a": "cat"', "is not JSON"),
    ("r", "abcd", "does not match"),
    ("c", "yes!", "is none of"),
])
def test_an_output_outside_its_grammar_fails_naming_the_request(rid, text, why):
    result = _check(GOOD, {**GOOD, rid: text})
    assert result.status == FAIL and result.request_id == rid and why in result.summary
    assert "async" in result.summary
    result = _check({**GOOD, rid: text}, GOOD)  # the reference is judged too
    assert result.status == FAIL and "reference" in result.summary


def test_an_output_cut_at_max_tokens_is_not_judged():
    assert _check(GOOD, {**GOOD, "r": "ab"}, {"r": "length"}).status == PASS
    none_completed = {rid: "length" for rid in GOOD}
    assert _check(GOOD, GOOD, none_completed).status == NA


def test_scenario_files_hold_structured_outputs_and_refuse_bad_ones(tmp_path):
    import json

    from conformance.workloads.files import ScenarioFileError, read_scenario_file, write_scenario_file
    from conformance.workloads.scenario import TIERS, EngineSettings, Scenario

    scenario = Scenario("so", "structured", TIERS[0], EngineSettings(), tuple(SPECS), ())
    path = write_scenario_file(tmp_path / "so.json", scenario, 260)
    assert read_scenario_file(path).requests == scenario.requests
    data = json.loads(path.read_text())
    data["requests"][1]["params"]["structured_outputs"] = {"regex": "a", "choice": ["b"]}
    path.write_text(json.dumps(data))
    with pytest.raises(ScenarioFileError, match="exactly one of"):
        read_scenario_file(path)
