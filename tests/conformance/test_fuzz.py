"""Generated workloads: valid, deterministic, covering the triggers; and the fuzzer's power.

The default tier runs a small fixed budget (same seed, same workloads); the nightly tier a larger one.
"""

from __future__ import annotations

import dataclasses
import io
import math

import pytest

from conformance.cli import main
from conformance.fuzz import explore, fuzz
from conformance.session import Selection
from conformance.workloads.files import read_scenario_file
from conformance.workloads.generate import GRAPH_MODES, Limits, roomy_pool, scenarios
from conformance.workloads.scenario import PATTERNS
from refengine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tests.conformance import planted_engine
from tests.conformance.caching_engines import CachingBugAdapter

VOCAB = 260
PLANTED = "tests.conformance.planted_engine:factory"
DEFAULT_BUDGET = 10  # workloads per default-tier fuzz run
DEFAULT_LIMITS = Limits(max_requests=4, max_new_tokens=8, max_prompt=16, max_arrival=6)
NIGHTLY_BUDGET = 300


def _generated(seed: int, n: int, **kw) -> list:
    seen = []

    def judge(sc, target):
        seen.append(sc)
        return (), None, None

    explore(scenarios(VOCAB, **kw), judge, seed=seed, max_examples=n)
    return seen


def test_generated_workloads_are_valid_engine_configurations():
    for sc in _generated(3, 150):
        s = sc.settings
        cfg = EngineConfig(graph_mode=sc.graph_mode if sc.graph_mode else "none", engine="async",
                           cache=CacheConfig(s.block_size, s.num_kv_blocks),
                           scheduler=SchedulerConfig(s.max_num_seqs, s.max_num_batched_tokens,
                                                     s.max_model_len or 1024),
                           speculative=SpeculativeConfig(s.k, s.drafter))  # raises for impossible configs
        assert cfg.scheduler.max_num_batched_tokens >= s.k + 1
        for r in sc.requests:
            assert 1 <= len(r.prompt) < cfg.scheduler.max_model_len
            assert all(0 <= t < VOCAB for t in (*r.prompt, *r.stop_token_ids))
            assert r.max_tokens >= 1 and (r.abort_step is None or r.abort_step >= r.arrival_step)


def test_generation_is_deterministic_for_a_seed():
    first = [sc.to_dict() for sc in _generated(7, 40)]
    assert first == [sc.to_dict() for sc in _generated(7, 40)]
    assert first != [sc.to_dict() for sc in _generated(8, 40)]


def test_generation_does_not_depend_on_what_the_process_imported():
    import json
    import subprocess
    import sys

    import refengine.config  # noqa: F401  (more modules loaded here than in the child)

    code = (
        "import json; from conformance.fuzz import explore; "
        "from conformance.workloads.generate import scenarios; seen = []; "
        "explore(scenarios(260), lambda sc, target: (seen.append(sc.to_dict()), ((), None, None))[1], "
        "seed=5, max_examples=60); print(json.dumps(seen))"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(child) == json.loads(json.dumps([sc.to_dict() for sc in _generated(5, 60)]))


def test_generated_workloads_cover_the_triggers():
    seen = _generated(0, 250)
    lengths = {(sc.k, len(r.prompt)) for sc in seen for r in sc.requests}
    for k in range(4):
        assert {(k, 1), (k, k + 1), (k, k + 2)} <= lengths
    assert any(len(r.prompt) == sc.settings.max_model_len - 1 for sc in seen if sc.settings.max_model_len
               for r in sc.requests)
    assert any(len(r.prompt) + r.max_tokens >= sc.settings.max_model_len for sc in seen
               if sc.settings.max_model_len for r in sc.requests)  # runs into the model length
    budgets = {(len(r.prompt) - sc.settings.max_num_batched_tokens) for sc in seen for r in sc.requests}
    assert {-1, 0, 1} <= budgets  # chunk boundaries
    assert {sc.graph_mode for sc in seen} == set(GRAPH_MODES)
    assert {sc.settings.pattern for sc in seen if sc.settings.drafter == "scripted"} == set(PATTERNS)
    assert any(sc.settings.drafter == "mtp" and sc.k for sc in seen)
    pressured = [sc for sc in seen if sc.settings.num_kv_blocks is not None]
    assert pressured and all(sc.settings.num_kv_blocks <= math.ceil(
        (sc.settings.max_model_len + 2 * sc.k + 1) / sc.settings.block_size) + 4 for sc in pressured)
    assert any(sc.settings.max_num_seqs < len(sc.requests) for sc in seen)  # seat pressure
    aborts = [r.abort_step - r.arrival_step for sc in seen for r in sc.requests if r.abort_step is not None]
    assert {0, 1, 2} <= set(aborts) and max(aborts) > 3  # before scheduling, in flight, later
    assert any(r.stop_token_ids for sc in seen for r in sc.requests)
    assert any(len({r.arrival_step for r in sc.requests}) > 2 for sc in seen)
    assert not any(r.abort_step is not None for sc in _generated(0, 50, aborts=False) for r in sc.requests)


def test_generated_workloads_cover_the_cache_and_drafter_geometries():
    """Blocks no longer than K, equal blocks at different offsets, and n-gram requests into max_model_len."""
    seen = _generated(0, 250, caching=True, ngram=True)
    cached = [sc for sc in seen if sc.settings.enable_prefix_caching]
    assert any(2 <= sc.settings.block_size <= sc.k for sc in cached)
    assert not any(sc.settings.block_size < 4 for sc in seen if not sc.settings.enable_prefix_caching)

    def at_offsets(sc):
        bs, where = sc.settings.block_size, {}
        for r in sc.requests:
            for i in range(len(r.prompt) // bs):
                where.setdefault(tuple(r.prompt[i * bs: (i + 1) * bs]), set()).add(i)
        return any(len(v) > 1 for v in where.values())

    assert any(at_offsets(sc) for sc in cached)
    assert any(sc.settings.drafter == "ngram" and sc.settings.max_model_len and any(
        len(r.prompt) + r.max_tokens >= sc.settings.max_model_len for r in sc.requests) for sc in seen)
    assert not any(sc.settings.drafter == "ngram" for sc in _generated(0, 50))


def test_default_fuzz_budget_passes_on_the_async_engine(tmp_path):
    """The default tier's fuzz run: a fixed seed and budget, every graph mode drawn, aborts included."""
    report = fuzz(
        Selection(engine="async").open_case(),
        seed=0,
        max_examples=DEFAULT_BUDGET,
        out_dir=tmp_path,
        limits=DEFAULT_LIMITS,
        shrink=False,
    )
    assert not report.failed, f"{report.search.check} failed; replay: {report.replay}"
    assert report.search.examples == DEFAULT_BUDGET and report.search.skipped == 0


def test_default_fuzz_budget_catches_a_mutant(tmp_path):
    """The same budget catches the stale-accepted-counts mutant (seed 000) without any hand-written
    scenario."""
    case = Selection(engine="mutant:stale-accepted-counts").open_case()
    report = fuzz(
        case, seed=0, max_examples=DEFAULT_BUDGET, out_dir=tmp_path, limits=DEFAULT_LIMITS, shrink=False
    )
    assert report.failed and report.search.examples <= DEFAULT_BUDGET
    assert report.reproduced and report.file.is_file()


def test_a_planted_failure_shrinks_to_a_minimal_replayable_file(tmp_path):
    case = Selection(engine=PLANTED).open_case()
    report = fuzz(case, seed=0, max_examples=DEFAULT_BUDGET, out_dir=tmp_path,
                  limits=Limits(max_requests=3, max_new_tokens=4, max_prompt=6, max_arrival=2, max_k=2))
    assert report.failed and report.search.check == "tokens" and report.reproduced
    shrunk = read_scenario_file(report.file, VOCAB)
    assert len(report.search.first.requests) > 1  # it was found on a bigger workload
    (only,) = shrunk.requests  # the smallest workload that still shows the bug
    assert len(only.prompt) == planted_engine.MIN_PROMPT and only.max_tokens == planted_engine.POSITION + 1
    assert shrunk.k == 1 and only.abort_step is None and only.arrival_step == 0
    assert report.replay == f"conformance replay --scenario-file {report.file} --engine {PLANTED}"
    out = io.StringIO()
    assert main(["replay", "--scenario-file", str(report.file), "--engine", PLANTED], out=out) == 1
    assert "[FAIL] tokens: request r00: first divergence at output position 2" in out.getvalue()
    assert main(["run", "--scenario-file", str(report.file), "--engine", "reference"], out=io.StringIO()) == 0


def test_fuzz_command_writes_the_shrunk_workload_and_its_replay(tmp_path):
    out = io.StringIO()
    code = main(
        [
            "fuzz",
            "--engine",
            PLANTED,
            "--examples",
            str(DEFAULT_BUDGET),
            "--max-requests",
            "2",
            "--max-prompt",
            "8",
            "--max-new-tokens",
            "6",
            "--no-shrink",
            "--out",
            str(tmp_path),
            "--seed",
            "1",
        ],
        out=out,
    )
    text = out.getvalue()
    assert code == 1, text
    assert "[   1] generate" in text and "check 'tokens' failed on a generated workload" in text
    (written,) = tmp_path.glob("*.json")
    assert f"replay: conformance replay --scenario-file {written} --engine {PLANTED}" in text
    assert "FAILED scenario fuzz-s1-tokens" in text


def test_fuzz_command_exits_0_when_nothing_fails(tmp_path):
    out = io.StringIO()
    assert (
        main(
            [
                "fuzz",
                "--engine",
                "reference",
                "--examples",
                "2",
                "--max-prompt",
                "8",
                "--out",
                str(tmp_path),
                "-q",
            ],
            out=out,
        )
        == 0
    )
    assert "no check failed (seed 0)" in out.getvalue() and not list(tmp_path.iterdir())


@pytest.mark.nightly
@pytest.mark.parametrize("engine", ["async", "async:full"])
def test_nightly_fuzz_budget(tmp_path, engine):
    limits = Limits(max_requests=8, max_arrival=20, max_new_tokens=24, max_prompt=64)
    report = fuzz(Selection(engine=engine).open_case(), seed=1, max_examples=NIGHTLY_BUDGET, out_dir=tmp_path,
                  limits=limits, shrink_seconds=120)
    assert not report.failed, f"{report.search.check} failed; replay: {report.replay}"


@pytest.mark.parametrize("mutant", ["stale-accepted-counts", "host-optimistic-positions"])
def test_regression_corpus_catches_the_mutant_it_was_shrunk_from(mutant):
    from conformance.harness import run_scenario

    result, _ = run_scenario(f"regression-{mutant}", Selection(engine=f"mutant:{mutant}").open_case())
    assert result.failures and not result.skipped


def test_regression_files_are_in_both_tiers_and_pending_ones_are_not():
    from conformance.workloads import scenario_ids
    from conformance.workloads.files import REGRESSIONS_DIR

    ids = {read_scenario_file(p).id for p in REGRESSIONS_DIR.glob("*.json")}
    assert ids and ids <= set(scenario_ids("default")) and ids <= set(scenario_ids("nightly"))
    pending = {read_scenario_file(p).id for p in (REGRESSIONS_DIR / "pending").glob("*.json")}
    assert not pending & set(scenario_ids("nightly"))


def test_known_bugs_are_counted_and_the_search_goes_on(tmp_path):
    case = Selection(engine=PLANTED).open_case()
    limits = Limits(max_requests=2, max_new_tokens=4, max_prompt=6, max_arrival=2)
    report = fuzz(case, seed=0, max_examples=6, out_dir=tmp_path, limits=limits, shrink=False,
                  known=lambda result: "planted" if result.failures[0].check == "tokens" else None)
    assert not report.failed and report.search.examples == 6 and report.search.known > 0
    assert not list(tmp_path.iterdir())


def test_with_prefix_caching_the_generator_draws_modes_shared_prefixes_and_next_turns():

    seen = _generated(2, 150, caching=True, limits=Limits(max_requests=5, max_prompt=40))
    modes = {sc.settings.mamba_cache_mode for sc in seen}
    assert modes == {None, "align", "all"}  # caching off, and on in both modes
    assert any("shared prefixes" in sc.description for sc in seen)
    shared = [sc for sc in seen if sum(1 for r in sc.requests if len(r.prompt) >= sc.settings.block_size) >= 2
              and len({r.prompt[: sc.settings.block_size] for r in sc.requests}) < len(sc.requests)]
    assert shared, "no two requests of a workload start with the same block"
    turns = [sc for sc in seen if any(r.extends is not None for r in sc.requests)]
    assert turns and all(sc.longest_prompt(r.request_id) < (sc.settings.max_model_len or 1024)
                         for sc in turns for r in sc.requests)
    roomy = [sc for sc in seen if sc.caching and sc.settings.num_kv_blocks >= roomy_pool(sc)]
    assert roomy, "no caching workload with a pool that evicts nothing (its counts would never be pinned)"
    for sc in seen:  # valid reference-engine configurations (raises for impossible ones)
        s = sc.settings
        EngineConfig(
            engine="reference",
            cache=CacheConfig(s.block_size, s.num_kv_blocks, s.enable_prefix_caching, s.mamba_cache_mode),
            scheduler=SchedulerConfig(s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len or 1024),
            speculative=SpeculativeConfig(s.k, s.drafter),
        )
    plain = _generated(2, 40)
    assert not any(sc.caching or any(r.extends for r in sc.requests) for sc in plain)


def test_fuzz_finds_a_cache_that_never_hits(tmp_path):
    """An engine that claims prefix caching but never hits: the generated caching workloads fail
    cached-tokens."""
    case = Selection(engine="reference").open_case()
    case = dataclasses.replace(case, engine="caching-bug:never-hits", adapter=CachingBugAdapter("never-hits"))
    report = fuzz(
        case, seed=0, max_examples=DEFAULT_BUDGET, out_dir=tmp_path, limits=DEFAULT_LIMITS, shrink=False
    )
    assert report.failed and report.search.check == "cached-tokens" and report.reproduced
    assert read_scenario_file(report.file, VOCAB).caching


def test_with_params_the_generator_draws_request_parameters():
    """Every id-only SamplingParams field comes up, each valid for its request; none without ``params``."""
    from refengine import SamplingParams

    seen = [r for sc in _generated(0, 120, params=True) for r in sc.requests]
    drawn = {name for r in seen for name, _ in r.params}
    assert drawn == {"allowed_token_ids", "logit_bias", "min_tokens", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "logprobs", "prompt_logprobs"}
    assert any(not r.params for r in seen)
    for r in seen:
        SamplingParams(max_tokens=r.max_tokens, **r.sampling)  # raises for an invalid field
        assert all(0 <= t < VOCAB for t in r.sampling.get("allowed_token_ids", ()))
    assert not any(r.params for sc in _generated(0, 40) for r in sc.requests)


def test_with_model_drafters_the_generator_draws_each_of_them():
    """EAGLE-3, EAGLE-1 and draft models (cut to one layer, or whole) in place of the drafted one, K > 0
    only; none without ``drafters``."""
    seen = _generated(0, 120, drafters=("eagle3", "eagle", "draft_model"))
    drawn = {(sc.settings.drafter, sc.settings.draft_model) for sc in seen}
    assert {("eagle3", None), ("eagle", None)} <= drawn
    assert {m for d, m in drawn if d == "draft_model"} in ({"cut:1"}, {"cut:all"}, {"cut:1", "cut:all"})
    assert all(sc.k for sc in seen if sc.settings.drafter in ("eagle3", "eagle", "draft_model"))
    assert not any(sc.settings.drafter in ("eagle3", "eagle", "draft_model") for sc in _generated(0, 60))


def test_a_shrink_judges_its_one_check_and_makes_the_later_runs_only_when_it_reads_them():
    """A fuzz shrink asks one check (run_scenario(only=...)): an early one is judged on the reference and
    test runs alone, a late one still gets the runs it reads."""
    from conformance.harness import run_scenario

    case = Selection(engine=PLANTED).open_case()
    result, traces = run_scenario("mtp-k3", case, only="tokens")
    assert [c.check for c in result.checks] == ["tokens"] and result.checks[0].failed
    assert set(traces) == {"reference", "test"}
    result, traces = run_scenario("mtp-k3", case, only="spec-lossless")
    assert [c.check for c in result.checks] == ["spec-lossless"] and "plain" in traces
    with pytest.raises(ValueError, match="no check is named 'token'"):
        run_scenario("mtp-k3", case, only="token")
