"""The test session's cache of reference traces (conformance/reference_cache.py): a hit is the run it
stands for, and anything the run depends on, or a swapped reference side, misses."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from conformance import reference_cache
from conformance.engines import RefEngineAdapter, cached_reference_adapter, reference_adapter
from conformance.harness import REFERENCE_LABEL, run_workload
from conformance.model import describe_model
from conformance.workloads import EngineSettings, RequestSpec, Scenario

REPO = Path(__file__).resolve().parents[2]


def _scenario(prompt=(5, 6, 7), sid="cache-probe") -> Scenario:
    requests = (RequestSpec("r0", prompt, 4), RequestSpec("r1", (9, 10), 3, arrival_step=1))
    return Scenario(sid, "a tiny workload", "default", EngineSettings(), requests)


@pytest.fixture
def facts(tiny_checkpoint, tmp_path):
    """A checkpoint of this test's own (the test changes its files)."""
    shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    return describe_model(str(tmp_path / "ckpt"))


def _key(adapter, scenario, facts, label=REFERENCE_LABEL, device="cpu", dtype="float32"):
    return reference_cache.key(adapter, scenario, facts, label, None, device, dtype)


def test_the_test_session_turns_it_on_and_no_command_does():
    assert reference_cache.enabled() and os.path.isdir(os.environ[reference_cache.DIR_ENV])
    for folder in ("conformance", "refengine"):
        for path in (REPO / folder).rglob("*.py"):
            assert "reference_cache.enable(" not in path.read_text(), path


def test_a_hit_is_a_copy_of_the_run_and_leaves_the_random_state_as_the_run_did(facts):
    scenario = _scenario(sid="cache-probe-hit")
    first = run_workload(reference_adapter(), scenario, facts, label=REFERENCE_LABEL)
    after_run = torch.get_rng_state()
    assert first.error is None and first.requests["r0"].token_ids
    hits = reference_cache.stats["hits"]
    torch.manual_seed(123)
    again = run_workload(reference_adapter(), scenario, facts, label=REFERENCE_LABEL)
    assert reference_cache.stats["hits"] == hits + 1
    assert again.to_dict() == first.to_dict() and again is not first
    assert torch.equal(torch.get_rng_state(), after_run)
    again.requests["r0"].token_ids.append(-1)  # a caller changing its copy changes no later hit
    third = run_workload(reference_adapter(), scenario, facts, label=REFERENCE_LABEL)
    assert third.to_dict() == first.to_dict()


def test_a_run_stored_by_another_process_is_served_from_the_folder(facts, monkeypatch):
    scenario = _scenario(sid="cache-probe-folder")
    first = run_workload(reference_adapter(), scenario, facts, label=REFERENCE_LABEL)
    after_run = torch.get_rng_state()
    monkeypatch.setattr(reference_cache, "_entries", OrderedDict())  # forgotten here, held by the folder
    hits = reference_cache.stats["hits"]
    torch.manual_seed(123)
    again = run_workload(reference_adapter(), scenario, facts, label=REFERENCE_LABEL)
    assert reference_cache.stats["hits"] == hits + 1
    assert again.to_dict() == first.to_dict() and torch.equal(torch.get_rng_state(), after_run)


def test_everything_the_run_depends_on_is_in_the_key(facts, monkeypatch):
    ref, scenario = reference_adapter(), _scenario()
    k = _key(ref, scenario, facts)
    assert k is not None and k == _key(reference_adapter(), _scenario(), facts)
    assert _key(ref, _scenario(prompt=(5, 6, 8)), facts) != k  # same id, other content
    assert _key(cached_reference_adapter(), scenario, facts) != k
    assert _key(ref, scenario, facts, label="other") != k
    assert _key(ref, scenario, facts, dtype="bfloat16") != k
    assert reference_cache.key(ref, scenario, facts, REFERENCE_LABEL, scenario.settings.plain(), "cpu",
                               "float32") != k
    assert _key(ref, scenario, dataclasses.replace(facts, vocab_size=facts.vocab_size - 1)) != k
    with monkeypatch.context() as m:
        m.setenv("KERNELS_BACKEND", "torch" if k[-1][0] == "triton" else "triton")
        assert _key(ref, scenario, facts) != k
    assert _key(ref, scenario, facts) == k
    config = Path(facts.path) / "config.json"
    config.write_text(config.read_text() + "\n")  # the checkpoint's bytes, at the same path
    assert _key(ref, scenario, facts) != k


def test_a_checkpoint_rewritten_at_the_same_size_is_read_again(facts):
    """The checkpoint's digest is kept by its files' names, sizes and times once they are a second old:
    bytes rewritten in place at the same size still change the key."""
    ref, scenario = reference_adapter(), _scenario()
    config = Path(facts.path) / "config.json"
    old = config.stat().st_mtime_ns - 5_000_000_000
    for f in Path(facts.path).iterdir():
        os.utime(f, ns=(old, old))
    k = _key(ref, scenario, facts)
    assert _key(ref, scenario, facts) == k  # known now, by the files' stamps
    text = config.read_text()
    config.write_text(text[:-1] + ("\n" if text[-1] != "\n" else " "))  # one byte changed, same size
    assert config.stat().st_size == len(text.encode()) and config.read_text() != text
    assert _key(ref, scenario, facts) != k


def test_a_swapped_reference_side_is_never_served(facts, monkeypatch):
    scenario = _scenario()

    class Sub(RefEngineAdapter):
        pass

    assert _key(Sub("reference", "none", uncached=True), scenario, facts) is None
    assert _key(RefEngineAdapter("async", "none"), scenario, facts) is None
    assert _key(reference_adapter(), scenario, facts, device="cuda") is None
    stock_build = RefEngineAdapter.build

    def recording_build(self, spec):
        return stock_build(self, spec)

    with monkeypatch.context() as m:
        m.setattr(RefEngineAdapter, "build", recording_build)
        assert _key(reference_adapter(), scenario, facts) is None
    import refengine
    import refengine.llm

    class OtherLLM(refengine.llm.LLM):
        pass

    with monkeypatch.context() as m:
        m.setattr(refengine, "LLM", OtherLLM)
        assert _key(reference_adapter(), scenario, facts) is None
    with monkeypatch.context() as m:
        m.setattr(reference_cache, "_enabled", False)
        m.delenv(reference_cache.DIR_ENV)
        assert _key(reference_adapter(), scenario, facts) is None
    assert _key(reference_adapter(), scenario, facts) is not None


def _scripted_llm(adapter, facts):
    """The adapter's LLM as the harness has it once started (the cache looks at what was built)."""
    from conformance.adapters.refengine import LLMInstance
    from conformance.api import RunSpec

    settings = EngineSettings(num_speculative_tokens=2, drafter="scripted")
    spec = RunSpec(facts.path, settings, facts.vocab_size, lambda rec: None)
    llm = adapter.build(spec)
    reference_cache.after_start(adapter, LLMInstance(llm), spec)
    return llm


def test_the_scripted_truth_is_shared_and_a_mutant_of_the_model_computes_its_own(facts, monkeypatch):
    import refengine.llm
    from conformance.mutants import MAMBA2_MUTANTS, MutantAdapter, get_mutant
    from refengine import SamplingParams
    from refengine.request import Request

    req = Request("r0", [5, 6, 7], SamplingParams(max_tokens=4), 0)
    llm = _scripted_llm(RefEngineAdapter("async", "none"), facts)
    own = refengine.llm.GreedyTruth(llm.config, llm.engine.model, llm.model_config)
    truth = llm.config.speculative.drafter.truth
    assert not isinstance(truth, refengine.llm.GreedyTruth)  # served through the cache
    assert truth(req) == own(req) and len(own(req)) == 4 + 2
    computed = []
    def run(self, reqs):  # the truth engine's run of the requests asked for and expected
        computed.extend(reqs)
        self._known.update({self._key(r): [1, 2] for r in reqs})

    monkeypatch.setattr(refengine.llm.GreedyTruth, "_run", run)
    monkeypatch.setattr(reference_cache, "_entries", OrderedDict())  # forgotten here, held by the folder
    again = _scripted_llm(reference_adapter(), facts).config.speculative.drafter.truth
    assert again(req) == own(req) and not computed  # the reference engine's drafter: the same truth
    other = Request("r0", [5, 6, 7], SamplingParams(max_tokens=5), 0)
    assert again(other) == [1, 2] and computed == [other]  # other parameters: computed
    # Not served: the mutants of the model's mixers (which the truth engine shares), and other adapters.
    mixer_mutant = MutantAdapter(MAMBA2_MUTANTS[0])
    for adapter in (mixer_mutant, type("Sub", (RefEngineAdapter,), {})("async", "none")):
        assert isinstance(_scripted_llm(adapter, facts).config.speculative.drafter.truth,
                          refengine.llm.GreedyTruth)
    assert not isinstance(_scripted_llm(MutantAdapter(get_mutant("stale-accepted-counts")), facts)
                          .config.speculative.drafter.truth, refengine.llm.GreedyTruth)
