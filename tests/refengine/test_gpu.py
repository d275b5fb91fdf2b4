"""The GPU tier: Triton kernels, CUDA streams and real CUDA-graph replays (skipped without CUDA)."""

from __future__ import annotations

import pytest

from refengine import LLM, SamplingParams
from tests.refengine.test_async_engine import drive, workload

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("graph_mode", ["none", "full", "full_and_piecewise"])
@pytest.mark.parametrize("k", [0, 3])
def test_async_on_cuda_equals_reference_on_cuda(k, graph_mode):
    items = workload(21, k, n=6)
    ref = drive(LLM(model=None, device="cuda", num_speculative_tokens=k), items)
    llm = LLM(model=None, device="cuda", engine="async", graph_mode=graph_mode, num_speculative_tokens=k)
    got = drive(llm, items)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}
    assert {r: o.acceptance for r, o in got.items()} == {r: o.acceptance for r, o in ref.items()}
    if graph_mode != "none":
        assert llm.engine.runner.graphs._graphs, "no CUDA graph was captured"


def test_cuda_engine_matches_cpu_engine_tokens():
    """Triton on the GPU against the torch references on CPU: same greedy tokens on the default model."""
    prompts = ["Once upon a time", "one two three four", "This class implements rational numbers."]
    params = SamplingParams(max_tokens=32)
    cpu = [o.token_ids for o in LLM(num_speculative_tokens=3).generate(prompts, params)]
    gpu = [o.token_ids for o in LLM(device="cuda", num_speculative_tokens=3).generate(prompts, params)]
    assert gpu == cpu


def test_delay_mode_forces_the_shared_host_buffer_race_on_cuda():
    """With copies delayed on the CUDA stream, a host buffer rewritten while its copy is pending is
    caught by the hazard checker, deterministically, as on CPU."""
    from conformance.mutants import get_mutant
    from refengine.async_engine.stream import HazardError

    llm = LLM(device="cuda", engine="async", graph_mode="full_and_piecewise", num_speculative_tokens=3,
              delay_copies=True, hazard_check=True)
    get_mutant("shared-host-buffer").patch(llm.engine)
    with pytest.raises(HazardError, match="step-inputs"):
        llm.generate(["Once upon a time", "one two three"] * 4, SamplingParams(max_tokens=16))


def _cached_and_ngram_run(device: str):
    """Prefix caching with shared prompts and the n-gram drafter, async engine with FULL graphs, against
    the reference engine without caching; returns (reference, async) outputs and the async engine."""
    system = list(range(3, 40)) * 2
    prompts = [system + [7, 8, 9], system + [10], [5, 6, 5, 6, 5, 6, 5], system[:20]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    common = {"device": device, "num_speculative_tokens": 3, "drafter": "ngram", "prompt_lookup_min": 2,
              "prompt_lookup_max": 4, "block_size": 16}
    ref = LLM(**common).generate(prompts, params)
    llm = LLM(engine="async", graph_mode="full_and_piecewise", enable_prefix_caching=True,
              mamba_cache_mode="all", **common)
    got = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)  # the rest hit the first
    return ref, got, llm


def test_prefix_caching_and_ngram_on_cuda_graphs_equal_the_uncached_reference():
    ref, got, llm = _cached_and_ngram_run("cuda")
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.acceptance for o in got] == [o.acceptance for o in ref]
    assert sum(o.num_cached_tokens for o in got) > 0, "nothing was served from the cache"
    assert llm.engine.runner.graphs._graphs, "no CUDA graph was captured"
