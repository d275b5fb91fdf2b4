"""EAGLE drafters in the suite: the drafts check compares their inputs and proposals row by row, the
cached-token bounds follow vLLM's drop-last-block rule, and ``conformance run --drafter``."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.checks.drafts import check_drafts
from conformance.checks.prefix_cache import Geometry, Published, ceiling
from conformance.harness import run_scenario
from conformance.mutants import MutantAdapter, get_mutant
from conformance.results import FAIL, PASS
from conformance.workloads import EngineSettings
from tests.conformance.test_cli import run_cli


@pytest.fixture(scope="module")
def eagle_case(small_case):
    from conformance.engines import RefEngineAdapter

    adapter = RefEngineAdapter("async", "full_and_piecewise")
    return dataclasses.replace(small_case, engine="async", adapter=adapter)


def test_drafts_check_compares_eagle_rows_and_fails_on_a_wrong_head(eagle_case):
    """The real async run passes row by row (the chained passes' ids included); with d2t not applied the
    proposals differ, and the drafts check names the row whatever the acceptance check said first."""
    result, traces = run_scenario("eagle3-k3", eagle_case)
    assert result.ok, result.checks
    good = check_drafts(traces["reference"], traces["test"], 3)
    assert good.status == PASS, good.summary
    chained = [r for r in traces["test"].steps for r in r.rows
               if r.output_token_ids is not None and len(r.drafter_input_ids) > len(r.output_token_ids)]
    assert chained, "sampling rows carry the chained passes' ids"
    mutated = dataclasses.replace(eagle_case, adapter=MutantAdapter(get_mutant("eagle3-d2t-not-applied")))
    _, bad = run_scenario("eagle3-k3", mutated)
    result = check_drafts(bad["reference"], bad["test"], 3)
    assert result.status == FAIL and result.request_id is not None, result.summary
    assert result.details["field"] in ("next_draft_token_ids", "drafter_input_ids")  # chained ids are drafts


def test_cached_token_ceiling_drops_the_last_matched_block():
    """A source that published blocks 4..16 with a state at each: plain keys hit 16, MTP's keys (one token
    more) need the token after the block, an EAGLE drafter drops the run's last block (vLLM's rule)."""
    prompt = tuple(range(30))
    ends = frozenset({4, 8, 12, 16})
    source = Published(prompt[:20], ends, ends)
    plain = Geometry.of(EngineSettings(block_size=4, enable_prefix_caching=True))
    eagle = Geometry.of(EngineSettings(num_speculative_tokens=3, drafter="eagle3", block_size=4,
                                       enable_prefix_caching=True))
    assert (plain.drop_last_block, eagle.drop_last_block) == (False, True)
    assert ceiling(prompt, [source], plain) == 16
    assert ceiling(prompt, [source], eagle) == 12
    assert ceiling(prompt[:9], [source], eagle) == 4  # the run is 4, 8 (h <= len - 1): drop 8
    assert eagle.last_stop(19) == 12 and plain.last_stop(19) == 16


def test_run_with_an_eagle_drafter_from_the_command_line(tiny_checkpoint, tmp_path):
    from refengine.tools.eagle_head import add_eagle_head

    head = tmp_path / "head"
    add_eagle_head(tiny_checkpoint, head, "eagle3", draft_vocab_size=200)
    code, out = run_cli("run", "--engine", "reference", "--model", tiny_checkpoint, "--scenario", "mtp-k1",
                        "--drafter", "eagle3", "--draft-model", str(head))
    assert code == 0, out
    assert "eagle_drafter 1 ran" in out
