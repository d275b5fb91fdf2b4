"""The corpus: stable ids, deterministic prompts, every trigger named, every config valid."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from conformance.checks import TRIGGERS
from conformance.workloads import TIERS, UnknownScenario, get_def, load_scenario, scenario_defs, scenario_ids
from conformance.workloads.files import REGRESSIONS_DIR, regression_defs

REPO = Path(__file__).resolve().parents[2]


def test_ids_are_sorted_unique_and_tiered():
    for tier in TIERS:
        ids = scenario_ids(tier)
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert set(scenario_ids("default")) < set(scenario_ids("nightly"))
    for name in (
        "short-prompts-k0",
        "short-prompts-k1",
        "short-prompts-k3",
        "chunk-tails-k3",
        "preemption-k3",
        "recycled-slots-k3",
        "graph-padding-k1",
        "churn-k3",
        "scripted-ragged-k3",
        "mtp-k3",
    ):
        assert name in scenario_ids("default")
    with pytest.raises(ValueError):
        scenario_ids("weekly")
    with pytest.raises(UnknownScenario):
        get_def("no-such-scenario")


def _prompts(tier: str, vocab: int) -> dict[str, list]:
    return {sid: [(r.request_id, r.prompt, r.max_tokens, r.arrival_step) for r in
                  load_scenario(sid, tier, vocab).requests] for sid in scenario_ids(tier)}


@pytest.mark.parametrize("tier", TIERS)
def test_materialising_twice_gives_the_same_prompts(tier):
    assert _prompts(tier, 256) == _prompts(tier, 256)


PROMPTS_CODE = ("import json; from conformance.workloads import load_scenario, scenario_ids; "
                "print(json.dumps({s: [list(r.prompt) for r in load_scenario(s, 'default', 199).requests] "
                "for s in scenario_ids('default')}))")


def quiet_env() -> dict[str, str]:
    """A bare environment for a child interpreter; it writes no bytecode (tests never write into the
    checkout)."""
    return {"PATH": "", "PYTHONDONTWRITEBYTECODE": "1"}


def prompts_in_child(env: Mapping[str, str], root: Path = REPO) -> dict[str, list]:
    """The default tier's prompts (vocabulary 199) built by another interpreter, with another hash seed,
    from the code under ``root`` (``env`` plus PYTHONPATH and PYTHONHASHSEED)."""
    env = {**env, "PYTHONPATH": str(root), "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", PROMPTS_CODE], cwd=root, env=env, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out)


def test_prompts_do_not_depend_on_the_process():
    """Another interpreter with another hash seed builds exactly the same workloads."""
    here = {
        s: [list(r.prompt) for r in load_scenario(s, "default", 199).requests]
        for s in scenario_ids("default")
    }
    assert prompts_in_child(quiet_env()) == here


def test_short_prompt_lengths_cover_1_k1_k2():
    for k in (0, 1, 3):
        lengths = {len(r.prompt) for r in load_scenario(f"short-prompts-k{k}", "default", 256).requests}
        assert {1, k + 1, k + 2} <= lengths


@pytest.mark.parametrize("vocab", [199, 256])
def test_every_scenario_is_well_formed(vocab):
    for d in scenario_defs():
        for tier in d.tiers:
            sc = d.materialize(tier, vocab)
            s = sc.settings
            assert set(sc.triggers) <= set(TRIGGERS), sc.id
            assert s.max_num_batched_tokens >= 1 + s.k
            limit = s.max_model_len or 1024
            for r in sc.requests:
                assert all(0 <= t < vocab for t in r.prompt)
                assert (
                    1 <= sc.longest_prompt(r.request_id) < limit and r.max_tokens >= 1 and r.arrival_step >= 0
                )
                assert r.extends is not None or r.prompt
            if s.num_kv_blocks is not None:  # one request of max_model_len must fit the pool
                assert s.num_kv_blocks * s.block_size >= limit + 2 * s.k


def test_nightly_is_bigger():
    """Every hand-written scenario; a regression replays one fixed workload in both tiers."""
    for sid in scenario_ids("default"):
        if "regression" in get_def(sid).tags:
            assert load_scenario(sid, "nightly", 256) == load_scenario(sid, "default", 256).__class__(
                **{**load_scenario(sid, "default", 256).__dict__, "tier": "nightly"})
            continue
        small = load_scenario(sid, "default", 256).requests
        big = load_scenario(sid, "nightly", 256).requests
        assert sum(r.max_tokens for r in big) > sum(r.max_tokens for r in small), sid


def test_only_the_regression_folders_own_files_join_the_corpus(tmp_path):
    """conformance/README.md: a workload waiting for its fix in a subfolder (``regressions/pending/``) joins
    no tier."""
    data = json.loads(min(REGRESSIONS_DIR.glob("*.json")).read_text())
    (tmp_path / "pending").mkdir()
    (tmp_path / "joined.json").write_text(json.dumps({**data, "id": "regression-joined"}))
    (tmp_path / "pending" / "waiting.json").write_text(json.dumps({**data, "id": "regression-waiting"}))
    assert [d.id for d in regression_defs(tmp_path)] == ["regression-joined"]


def test_the_readme_lists_every_trigger():
    readme = (REPO / "conformance" / "README.md").read_text()
    listed = {
        line.split("`")[1] for line in readme.splitlines() if line.startswith("| `") and line.count("|") == 3
    }
    assert set(TRIGGERS) <= listed, f"triggers missing from conformance/README.md: {set(TRIGGERS) - listed}"
