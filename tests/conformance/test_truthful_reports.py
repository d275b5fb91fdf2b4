"""Reports that tell the truth: where a token was produced is read from the engine's own step records,
an engine whose outputs disagree with its records fails, spec-lossless blames speculation only when the
engine is right without it, and the text reads right (dtype, an output that ended, long ids)."""

from __future__ import annotations

import re

from conformance.harness import run_scenario
from conformance.runner import dtype_note
from conformance.session import Selection

SWAPPING = "tests.conformance.gate_engines:swapping"
TRUNCATING = "tests.conformance.gate_engines:truncating"
CORRUPT = "tests.conformance.corrupt_engine:factory"  # flips one token whatever K is
PLANTED = "tests.conformance.planted_engine:factory"  # flips one token only when K > 0


def _run(engine: str, scenario: str, model: str):
    result, traces = run_scenario(scenario, Selection(engine=engine, model=model).open_case())
    return {c.check: c for c in result.checks}, traces


def test_an_engine_whose_outputs_disagree_with_its_records_fails(tiny_checkpoint):
    checks, _ = _run(SWAPPING, "short-prompts-k0", tiny_checkpoint)
    rec = checks["output-records"]
    assert rec.failed, rec.summary
    assert re.search(r"output position \d+ is token \d+, but the engine's step record of engine step \d+ "
                     r"shows token \d+ there", rec.summary)
    tokens = checks["tokens"]
    assert tokens.failed
    # the report does not claim the swapped-in token was produced where the records show another one
    assert "by its step record, which shows token" in tokens.report
    assert "the output disagrees with the engine's own record" in tokens.report


def test_the_reference_engine_agrees_with_its_own_records(tiny_checkpoint):
    checks, _ = _run("reference", "short-prompts-k3", tiny_checkpoint)
    assert checks["output-records"].status == "pass", checks["output-records"].summary


def test_an_output_that_ended_is_said_so(tiny_checkpoint):
    checks, _ = _run(TRUNCATING, "short-prompts-k0", tiny_checkpoint)
    report = checks["tokens"].report
    assert "past the end" not in report
    ended = r"truncating : .*\[end\]   \(the output ended after \d+ tokens, finish 'length'\)"
    assert re.search(ended, report), report
    assert checks["output-records"].status == "pass"  # the records show more: a prefix is consistent


def test_spec_lossless_blames_speculation_only_when_the_engine_is_right_without_it(tiny_checkpoint):
    checks, traces = _run(CORRUPT, "short-prompts-k3", tiny_checkpoint)
    report = checks["spec-lossless"].report
    assert checks["spec-lossless"].failed and "test-plain" in traces
    assert "speculative decoding changed the output" not in report
    assert "with speculation off (K=0) the engine under test differs as well" in report
    assert "the bug is not in speculative decoding" in report
    checks, _ = _run(PLANTED, "short-prompts-k3", tiny_checkpoint)
    report = checks["spec-lossless"].report
    assert report.startswith("speculative decoding changed the output: with speculation off (K=0) the engine "
                             "under test matches plain greedy decoding"), report


def test_the_dtype_note_does_not_repeat_itself():
    assert "as in float32" not in dtype_note("float32")
    assert dtype_note("bfloat16").endswith("logits bitwise, in bfloat16 as in float32")


def test_step_tables_align_long_request_ids(tiny_checkpoint):
    from conformance.report_text import format_step_table

    _, traces = _run("reference", "short-prompts-k0", tiny_checkpoint)
    trace = traces["reference"]
    for step in trace.steps:
        for row in step.rows:
            row.request_id = row.request_id + "-a-much-longer-request-id" * (row.request_id.endswith("1"))
    lines = [line for line in format_step_table({"reference": trace}).splitlines()
             if re.search(r"\b(prefill|decode)\b", line)]
    columns = {line.index(" prefill ") if " prefill " in line else line.index(" decode ") for line in lines}
    assert len(lines) > 2 and len(columns) == 1, "the kind column starts at one offset on every row"
