"""The suite's power does not depend on the checkpoint: scenarios built for an acceptance pattern script
it (``gaps`` drafts), a trigger a scenario misses fails the gate unless --allow-unexercised says otherwise,
and the Mamba2 record's mutants are caught on a Nemotron-H that transformers writes, not only on the
preset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from filelock import FileLock

from conformance.mutants import get_mutant
from conformance.mutants.mamba2 import MAMBA2_MUTANTS
from conformance.mutants.run import run_mutant
from conformance.workloads import EngineSettings, RequestSpec
from conformance.workloads.files import write_scenario_file
from conformance.workloads.scenario import Scenario
from refengine.drafters import ScriptedDrafter
from tests.conformance.test_cli import run_cli

REPO = Path(__file__).resolve().parents[2]
# The two whose scenarios once reached their trigger only where the model accepted n-gram or MTP drafts.
ACCEPTANCE_MUTANTS = ("mamba2-no-count-without-drafts", "mamba2-spec-nonspec-not-split")


@pytest.fixture(scope="session")
def transformers_nemotron_h(shared_dir) -> str:
    """A Nemotron-H written by transformers' save_pretrained, given a head by ``refengine add-mtp-head``."""
    from refengine.tools.mtp_head import add_mtp_head
    from tests.helpers.nemotron_checkpoints import write_checkpoint

    target = shared_dir / "power-nemotron-h-with-head"
    with FileLock(str(shared_dir / "power-nemotron-h-with-head.lock")):
        if not (target / "mtp.safetensors").is_file():
            src = write_checkpoint(shared_dir / "power-nemotron-h-src", "nemotron-dense")
            add_mtp_head(src, target)
    return str(target)


@pytest.mark.parametrize("k", [1, 3])
def test_gaps_script_accepted_drafts_then_a_step_without_any(k):
    d = ScriptedDrafter(k, 256, "gaps")
    walk, m = [], 1  # each step commits the correct drafts and the bonus token
    for _ in range(8):
        n, c = d.schedule("r00", m)
        walk.append((n, c))
        m += c + 1
    cycle = [(k, k), (0, 0)] + ([(k - 1, k - 1), (0, 0)] if k > 1 else [])
    assert walk == (cycle * 4)[:8]
    assert d.schedule("r00", 2) == (0, 0)  # off the cycle: none until it comes round
    assert ScriptedDrafter(k, 256, "hash").schedule("r00", 1)[0] == k  # other patterns always propose K


@pytest.mark.parametrize("mutant", ACCEPTANCE_MUTANTS)
def test_acceptance_mutants_are_caught_on_a_transformers_written_nemotron_h(mutant,
                                                                           transformers_nemotron_h):
    result = run_mutant(get_mutant(mutant), transformers_nemotron_h, preferred_only=True)
    assert result.caught, (mutant, result)
    assert result.scenario == "scripted-zero-draft-k3"


@pytest.mark.slow
@pytest.mark.parametrize("mutant", [m.id for m in MAMBA2_MUTANTS])
def test_every_mamba2_mutant_is_caught_on_a_transformers_written_nemotron_h(mutant, transformers_nemotron_h):
    result = run_mutant(get_mutant(mutant), transformers_nemotron_h)
    assert result.caught, (mutant, result)


def _missing_a_trigger(tmp_path) -> Path:
    """A workload that names preemption as its point and cannot preempt (one short request)."""
    request = RequestSpec("r00", (1, 2, 3), 2)
    scenario = Scenario("misses-preemption", "", "default", EngineSettings(), (request,), ("preemption",))
    path = write_scenario_file(tmp_path / "misses.json", scenario, 256)
    data = json.loads(path.read_text())
    data["triggers"] = ["preemption"]
    path.write_text(json.dumps(data))
    return path


def test_a_missed_trigger_fails_the_run_on_any_model_unless_allowed(tiny_checkpoint, tmp_path):
    path = str(_missing_a_trigger(tmp_path))
    argv = ("run", "--engine", "reference", "--model", tiny_checkpoint, "--scenario-file", path)
    code, out = run_cli(*argv)
    assert code == 1 and "workload-triggers" in out and "never hit preemption" in out, out
    code, out = run_cli(*argv, "--allow-unexercised")
    assert code == 0 and "not exercised on this model: preemption" in out, out
    assert "a trigger a scenario misses is a warning (--allow-unexercised)" in out


def test_the_plugin_takes_allow_unexercised(tiny_checkpoint, tmp_path, pytester):
    from tests.conformance.test_plugin import run_suite

    base = ("-q", "--conformance-engine", "reference", "--conformance-model", tiny_checkpoint,
            "--conformance-scenario-file", str(_missing_a_trigger(tmp_path)))
    missed = run_suite(pytester, *base)
    assert missed.returncode == 1 and "workload-triggers" in missed.stdout, missed.stdout + missed.stderr
    allowed = run_suite(pytester, *base, "--conformance-allow-unexercised")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr


def test_the_nightly_gate_refuses_allow_unexercised(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(REPO / "ci"))
    import nightly

    for flag in ("--allow-unexercised", "--conformance-allow-unexercised"):
        with pytest.raises(SystemExit) as info:
            nightly.main(["--reports", str(tmp_path), flag])
        assert info.value.code == 2
        assert "the nightly gate never allows a missed workload trigger" in capsys.readouterr().err
