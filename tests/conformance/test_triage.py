"""``conformance triage``: a near-tie of this project's async engine in bfloat16 is named numerics, a mutant's
divergence structural with the control that clears it, and the scenario file it writes replays it."""

from __future__ import annotations

import json

import pytest

from conformance.verdict import calibrated_tolerance
from conformance.workloads.files import read_scenario_file
from tests.conformance.test_cli import run_cli

NEMOTRON = "tiny:nemotron_h"


def test_a_bfloat16_near_tie_of_the_async_engine_is_numerics(tmp_path):
    """On the tiny Nemotron-H, prompt [115] with MTP K=3: bfloat16 rounding flips the pick at output position
    3 (the float32 reference's own run has 48 there, the engine 124, 0.079 nats below it)."""
    out = tmp_path / "t.json"
    code, text = run_cli("triage", "--engine", "async", "--model", NEMOTRON, "--dtype", "bfloat16",
                         "--prompt-ids", "115", "--max-tokens", "8", "-k", "3", "--out", str(out))
    assert code == 0, text
    tolerance, _ = calibrated_tolerance("bfloat16", "float32")
    assert f"tolerance {tolerance:.4g} nats" in text
    assert "request r00 (1-token prompt, 8 output tokens): first divergence at output position 3" in text
    assert "token 124: 0.07946 nats below the reference's pick" in text and "token 48 (margin 0" in text
    assert "reference's own run: 118 4 96 [48]" in text
    assert "acceptance per verify step (drafted/engine accepted/reference accepted on the same drafts" in text
    for control in ("speculation off (K=0)         : 1 divergence(s), the first at 3",
                    "batch of one (r00 alone)      : n/a (it is the only request)",
                    "prefix cache off              : n/a (the workload does not cache)",
                    "the reference in bfloat16     : no divergence"):
        assert control in text, text
    assert ("verdict: near-tie: within bfloat16 noise (worst margin 0.07946 <= tolerance "
            f"{tolerance:.4g}") in text
    scenario = read_scenario_file(out, 256, "default")
    assert [r.prompt for r in scenario.requests] == [(115,)] and scenario.settings.k == 3
    origin = json.loads(out.read_text())["origin"]
    assert origin["triage"]["position"] == 3 and origin["triage"]["token"] == 124
    assert f"replay: conformance run --scenario-file {out} --engine async --model {NEMOTRON}" in text


@pytest.mark.slow
def test_a_mutants_divergence_is_structural_and_its_file_replays(tmp_path):
    """pad-rows-on-a-real-slot (FULL-graph padding rows write a real slot) on the embedded default model in
    bfloat16: 5.8 nats below the reference's pick, clean with speculation off; the file fails again."""
    from conformance.model import describe_model
    from conformance.workloads import get_def
    from conformance.workloads.files import write_scenario_file

    vocab = describe_model(None).vocab_size
    scenario = get_def("mtp-k1").materialize("default", vocab)
    workload = write_scenario_file(tmp_path / "mtp-k1.json", scenario, vocab)
    out = tmp_path / "t.json"
    code, text = run_cli("triage", "--engine", "mutant:pad-rows-on-a-real-slot", "--dtype", "bfloat16",
                         "--scenario-file", str(workload), "--out", str(out))
    assert code == 1, text
    assert "structural" in text and "verdict: structural: the drafter path" in text, text
    assert "speculation off (K=0)         : no divergence" in text
    code, replay = run_cli("run", "--scenario-file", str(out), "--engine", "mutant:pad-rows-on-a-real-slot",
                           "--dtype", "bfloat16", "--verdict", "rescored", "--reference-dtype", "float32")
    assert code == 1 and "rescored" in replay and "structural" in replay, replay
