"""The suite's prefix-caching side: the ceiling rules, multi-turn workloads, the caching scenarios on the
reference engine, and each new check failing on an engine with the bug it exists for
(tests/conformance/caching_engines.py)."""

from __future__ import annotations

import dataclasses
import io
import json
from types import SimpleNamespace

import pytest

from conformance import harness, plugin
from conformance.checks import check_cached_tokens
from conformance.checks.prefix_cache import Geometry, Published, ceiling, settled
from conformance.cli import main
from conformance.engines import load_engine, reference_adapter
from conformance.harness import run_scenario
from conformance.results import FAIL, NA, PASS
from conformance.runner import suite_args
from conformance.session import Selection
from conformance.trace import RequestTrace
from conformance.workloads import EngineSettings, RequestSpec, Scenario, load_scenario, scenario_ids
from conformance.workloads.files import ScenarioFileError, read_scenario_file, write_scenario_file
from tests.conformance.caching_engines import CachingBugAdapter

CACHING_IDS = [sid for sid in scenario_ids("default") if sid.startswith("prefix-")]
EDGES = "prefix-block-edges-k0"  # every wave-2 count pinned exactly (mode all, K=0)
CACHE_CHECKS = ("cache-lossless", "cached-tokens", "restored-state")


@pytest.fixture(scope="module")
def reference_case():
    return Selection(engine="reference").open_case()


def _run(case, scenario, adapter=None):
    if adapter is not None:
        case = dataclasses.replace(case, engine=adapter.name, adapter=adapter)
    result, traces = run_scenario(scenario, case)
    return {c.check: c for c in result.checks}, traces


# ---- the ceiling ----------------------------------------------------------------------------------

def _finished(prompt, output, acceptance=()):
    return RequestTrace("s", list(prompt), list(output), "length", list(acceptance))


def test_a_finished_request_leaves_states_where_its_mode_keeps_them():
    src = _finished(range(10), range(100, 107))  # 17 tokens, 16 committed
    everywhere = settled(src, Geometry(4, "all", 0))
    assert everywhere.kv == everywhere.states == {4, 8, 12, 16}
    aligned = settled(src, Geometry(4, "align", 0))  # its prompt's last checkpoint (8), then decode ones
    assert aligned.kv == {4, 8, 12, 16} and aligned.states == {8, 12, 16}
    mtp = settled(
        _finished(range(10), range(100, 107), [(1, 1), (1, 0), (1, 1), (1, 1)]), Geometry(4, "all", 1)
    )
    assert mtp.states == {4, 8, 12, 16}  # the last verify step's blocks too: the drafter wrote their KV
    on_grid = settled(_finished(range(12), range(100, 103)), Geometry(4, "align", 0))
    assert on_grid.states == {8, 12}  # a prompt on the grid: its prefill stops at (12 - 1) // 4 * 4 and 12
    on_grid_mtp = settled(_finished(range(13), range(100, 103)), Geometry(4, "align", 1))
    assert on_grid_mtp.kv == {4, 8, 12} and on_grid_mtp.states == {12}  # (13 - 1) // 4 * 4


@pytest.mark.parametrize("length,want", [(11, 8), (12, 8), (13, 12), (17, 16), (18, 16), (3, 0)])
def test_a_hit_leaves_the_last_prompt_token_to_compute(length, want):
    base = tuple(range(40))
    src = Published(base, frozenset(range(4, 40, 4)), frozenset(range(4, 40, 4)))
    assert ceiling(base[:length], [src], Geometry(4, "all", 0)) == want


def test_a_hit_needs_every_block_before_its_checkpoint_and_the_keys_lookahead():
    base = tuple(range(40))
    gap = Published(base, frozenset({4, 12}), frozenset({4, 12}))  # no KV block at 8: the chain stops
    assert ceiling(base[:20], [gap], Geometry(4, "all", 0)) == 4
    other = (*base[:12], 99)  # agrees on 12 tokens, not on the 13th
    src = Published(other, frozenset({4, 8, 12}), frozenset({12}))
    assert ceiling(base[:20], [src], Geometry(4, "all", 0)) == 12
    # an MTP key covers the token after the block
    assert ceiling(base[:20], [src], Geometry(4, "all", 1)) == 0


# ---- multi-turn workloads -----------------------------------------------------------------------

def _chat() -> Scenario:
    first = RequestSpec("r00", (5, 6, 7, 8, 9), 6)
    turn = RequestSpec("r01", (10, 11), 4, arrival_step=0, extends="r00")  # due at 0, but waits for r00
    settings = EngineSettings(
        block_size=4, enable_prefix_caching=True, mamba_cache_mode="all", num_kv_blocks=300, max_model_len=64
    )
    return Scenario(
        "chat", "a two-turn chat", "default", settings, (first, turn), ("prefix-hit", "hit-on-output")
    )


def test_a_next_turn_is_added_after_the_reply_with_it_in_its_prompt(reference_case):
    checks, traces = _run(reference_case, _chat())
    assert all(c.status != FAIL for c in checks.values()), [c.summary for c in checks.values() if c.failed]
    for label in ("reference", "test"):
        first, turn = traces[label].requests["r00"], traces[label].requests["r01"]
        assert turn.prompt_token_ids == first.prompt_token_ids + first.token_ids + [10, 11]
        assert turn.added_at >= first.returned_at
    assert traces["test"].requests["r01"].num_cached_tokens == 8  # 11 tokens committed: blocks 4, 8
    assert checks["workload-triggers"].status == PASS  # the hit reached tokens r00 generated


def test_next_turns_are_validated():
    with pytest.raises(ValueError, match="not an earlier request"):
        Scenario("x", "", "default", EngineSettings(), (RequestSpec("r00", (1,), 2, extends="r01"),))
    aborted = RequestSpec("r00", (1,), 2, abort_step=1)
    with pytest.raises(ValueError, match="which the workload aborts"):
        Scenario("x", "", "default", EngineSettings(), (aborted, RequestSpec("r01", (), 2, extends="r00")))
    with pytest.raises(ValueError, match="token ids, not text"):
        RequestSpec("r01", "text", 2, extends="r00")


def test_next_turns_survive_a_scenario_file(tmp_path):
    path = write_scenario_file(tmp_path / "chat.json", _chat(), 260)
    assert read_scenario_file(path, 260).requests == _chat().requests
    data = json.loads(path.read_text())
    data["requests"][1]["extends"] = "r07"
    path.write_text(json.dumps(data))
    with pytest.raises(ScenarioFileError, match="chat.json: request r01 extends 'r07'"):
        read_scenario_file(path, 260)


# ---- the caching scenarios on the reference engine ----------------------------------------------

# The shipped suite (tests/conformance/test_suite.py) runs every caching scenario on the async engine,
# with the reference engine's cached run as its third trace; here the reference engine is the engine
# under test for one scenario by default, for all of them with -m slow.
@pytest.mark.parametrize("scenario_id", [CACHING_IDS[0], *(pytest.param(s, marks=pytest.mark.slow)
                                                           for s in CACHING_IDS[1:])])
def test_caching_scenarios_pass_and_hit_on_the_reference_engine(reference_case, scenario_id):
    """Self-conformance of the cached reference engine; the triggers prove every scenario really hit."""
    checks, traces = _run(reference_case, scenario_id)
    assert not [c for c in checks.values() if c.failed], [
        (c.check, c.summary) for c in checks.values() if c.failed
    ]
    assert all(checks[name].status == PASS for name in (*CACHE_CHECKS, "workload-triggers"))
    assert traces["cached"] is traces["test"]  # the reference engine under test is its own cached run
    assert any(r.num_cached_tokens for r in traces["test"].requests.values())


def test_the_pinned_counts_are_the_cached_reference_engines(reference_case):
    checks, traces = _run(reference_case, EDGES)
    assert "16 requests within their ceilings (16 pinned exactly)" in checks["cached-tokens"].summary
    counts = {rid: r.num_cached_tokens for rid, r in traces["test"].requests.items()}
    assert [counts[f"r{i:02d}"] for i in range(4, 16)] == [8, 8, 8, 12, 12, 12, 16, 16, 16, 20, 20, 20]


def test_caching_scenarios_are_skipped_for_an_engine_that_cannot_cache(reference_case):
    """An adapter that does not claim "prefix_caching" (here the oracle's, which strips the cache) skips
    them."""
    case = dataclasses.replace(reference_case, engine="uncached", adapter=reference_adapter())
    result, traces = run_scenario(EDGES, case)
    assert result.skipped == "the engine under test does not support prefix caching" and not traces
    assert not reference_adapter().supports("prefix_caching")
    assert all(load_engine(e).supports("prefix_caching") for e in ("reference", "async", "async:full"))


# ---- each check fails on an engine with its bug -------------------------------------------------

@pytest.mark.parametrize("bug,check,words", [
    ("never-hits", "cached-tokens", "0 cached tokens, expected 8"),
    ("overclaims", "cached-tokens", "12 cached tokens, expected 8"),
    ("skips-restore", "restored-state", "first logits after a hit of"),
    ("corrupts-after-hit", "tokens", "first divergence at output position 0"),
    ("leaks-a-block", "pools-empty", "1 KV blocks"),
    ("miscounts-hits", "cached-tokens", "prefix_cache_hits=0"),
])
def test_each_planted_caching_bug_fails_its_check(reference_case, bug, check, words):
    checks, _ = _run(reference_case, EDGES, CachingBugAdapter(bug))
    assert checks[check].status == FAIL and words in checks[check].summary, (checks[check].summary, bug)
    if bug in (
        "never-hits",
        "leaks-a-block",
        "miscounts-hits",
    ):  # the outputs are right: only its check sees it
        assert checks["tokens"].status == PASS and checks["logits-digests"].status == PASS
    if bug == "never-hits":
        assert checks["restored-state"].status == NA


def test_the_correct_cached_engine_under_another_name_passes_with_a_third_run(reference_case):
    checks, traces = _run(reference_case, EDGES, CachingBugAdapter("correct"))
    assert all(c.status != FAIL for c in checks.values())
    assert traces["cached"] is not traces["test"] and traces["cached"].engine == harness.CACHED_LABEL


def test_a_reference_engine_whose_cache_changes_its_output_fails_cache_lossless(reference_case, monkeypatch):
    monkeypatch.setattr(harness, "cached_reference_adapter", lambda: CachingBugAdapter("skips-restore"))
    checks, _ = _run(reference_case, EDGES, CachingBugAdapter("correct"))
    assert checks["cache-lossless"].status == FAIL and checks["cache-lossless"].summary.startswith(
        "with caching vs without, request")
    assert checks["tokens"].status == PASS  # the engine under test is right; the oracle's own cache is not


def test_a_cached_run_that_never_hits_misses_the_prefix_hit_trigger(reference_case, monkeypatch):
    monkeypatch.setattr(harness, "cached_reference_adapter", lambda: CachingBugAdapter("never-hits"))
    checks, _ = _run(reference_case, EDGES, CachingBugAdapter("correct"))
    assert checks["workload-triggers"].status == FAIL
    assert set(checks["workload-triggers"].details["missed"]) == {"prefix-hit", "hit-block-edges"}


def test_without_caching_a_reported_cached_token_fails(reference_case):
    _, traces = _run(reference_case, "short-prompts-k1")
    sc = load_scenario("short-prompts-k1", "default", 260)
    assert check_cached_tokens(sc, traces["test"]).status == PASS
    traces["test"].requests["r01"].num_cached_tokens = 16
    result = check_cached_tokens(sc, traces["test"])
    assert result.failed and "with prefix caching off" in result.summary


# ---- the command line ---------------------------------------------------------------------------

def test_run_with_prefix_caching_forced_on_every_scenario():
    out = io.StringIO()
    assert main(["run", "--engine", "reference", "--scenario", "short-prompts-k1", "--enable-prefix-caching",
                 "--mamba-cache-mode", "all", "-v"], out=out) == 0
    text = out.getvalue()
    assert "prefix caching: on for the engine under test in every scenario, mode all" in text
    assert "prefix-caching/all" in text and "[PASS] cached-tokens" in text and "[PASS] cache-lossless" in text


def test_a_mamba_cache_mode_needs_prefix_caching(capsys):
    assert main(["run", "--engine", "reference", "--mamba-cache-mode", "all"], out=io.StringIO()) == 2
    assert "needs prefix caching enabled (--enable-prefix-caching)" in capsys.readouterr().err


def test_the_flags_reach_the_plugin_and_the_replay_command(reference_case):
    sel = Selection(engine="reference", enable_prefix_caching=True, mamba_cache_mode="align")
    args = suite_args(sel)
    assert "--conformance-enable-prefix-caching" in args
    assert args[args.index("--conformance-mamba-cache-mode") + 1] == "align"
    case = dataclasses.replace(reference_case, enable_prefix_caching=True, mamba_cache_mode="align")
    assert case.replay_command("x").endswith("--enable-prefix-caching --mamba-cache-mode align")
    assert case.apply(Scenario("x", "", "default", EngineSettings(), ())).settings.mamba_cache_mode == "align"


@pytest.mark.parametrize(
    "enable,mode,error",
    [
        (True, "all", None),
        (False, None, None),
        (True, "sometimes", "one of"),
        (False, "align", "needs --conformance-enable-prefix-caching"),
    ],
)
def test_the_plugins_caching_options_are_checked_up_front(monkeypatch, enable, mode, error):
    monkeypatch.delenv("CONFORMANCE_DTYPE", raising=False)
    opts = {
        "conformance_threads": 1,
        "conformance_enable_prefix_caching": enable,
        "conformance_mamba_cache_mode": mode,
    }
    config = SimpleNamespace(getoption=lambda name: opts.get(name))
    if error is None:
        plugin._check_options(config)
    else:
        with pytest.raises(pytest.UsageError, match=error):
            plugin._check_options(config)


# ---- the lower bound follows vLLM 0.33's hit rules ------------------------------------------------

class _OldRuleAdapter(CachingBugAdapter):
    """The reference engine with its cache, with one of the hit rules vLLM 0.33 has and it once lacked
    taken back: ``old-align-split`` (a prompt's prefill stops at L - L % B), ``last-step-unpublished`` (a
    finishing request's last step publishes nothing)."""

    def __init__(self, rule: str):
        super().__init__("correct")
        self.rule, self.name = rule, f"old-rule:{rule}"

    def start(self, spec):
        from conformance.engines import LLMInstance

        llm = self.build(spec)
        prefix = llm.engine.core.scheduler.prefix
        if self.rule == "old-align-split":
            def clip(num_computed, num_new, total, shared=0):
                last = total - total % prefix.block_size
                if num_computed < last < num_computed + num_new:
                    return last - num_computed
                return num_new

            prefix.clip = clip
        else:
            publish = prefix.publish
            prefix.publish = lambda spans: publish([s for s in spans if not s.request.is_finished])
        return LLMInstance(llm)


def _resent(k: int, second: RequestSpec) -> Scenario:
    settings = EngineSettings(block_size=4, enable_prefix_caching=True, mamba_cache_mode="align",
                              num_kv_blocks=300, max_model_len=64, num_speculative_tokens=k)
    first = RequestSpec("r00", tuple(range(20, 20 + (12 if k == 0 else 11))), 6)
    return Scenario("resent", "a prompt sent again", "default", settings, (first, second), ("prefix-hit",))


@pytest.mark.parametrize("rule,k,second,want", [
    ("old-align-split", 0, RequestSpec("r01", tuple(range(20, 32)), 3, arrival_step=30), 8),
    ("last-step-unpublished", 3, RequestSpec("r01", (7, 8, 9), 3, arrival_step=0, extends="r00"), 16),
])
def test_the_lower_bound_holds_an_engine_to_vllms_hit_rules(reference_case, rule, k, second, want):
    """A 12-token prompt resent (align, B=4) must hit 8: its prefill stopped at (12 - 1) // 4 * 4 too; a
    next turn after an 11-token prompt and 6 outputs with MTP (K=3) must hit 16, which only the first
    request's last step reached. An engine without the rule fails cached-tokens; the reference passes."""
    checks, _ = _run(reference_case, _resent(k, second))
    assert checks["cached-tokens"].status == PASS and "(2 pinned exactly)" in checks["cached-tokens"].summary
    checks, _ = _run(reference_case, _resent(k, second), _OldRuleAdapter(rule))
    assert checks["cached-tokens"].status == FAIL, checks["cached-tokens"].summary
    assert f"expected {want}" in checks["cached-tokens"].summary
