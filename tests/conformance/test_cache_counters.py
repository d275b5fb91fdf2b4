"""A request asking for prompt logprobs reads no cached prefix (vLLM computes them over the whole prompt),
and the engine's lookup counters leave it out: the cached-tokens check holds an engine to both."""

from __future__ import annotations

from conformance.checks import check_cached_tokens
from conformance.harness import run_scenario
from conformance.results import FAIL, PASS
from conformance.workloads import EngineSettings, RequestSpec, Scenario

PROMPT = tuple(range(30, 42))  # 12 tokens: three blocks of 4


def _resent(prompt_logprobs: bool) -> Scenario:
    """A prompt, then the same prompt twice once it finished: one of them asking for prompt logprobs."""
    settings = EngineSettings(block_size=4, enable_prefix_caching=True, mamba_cache_mode="all",
                              num_kv_blocks=64, max_model_len=32)
    asked = {"prompt_logprobs": 1} if prompt_logprobs else {}
    requests = (RequestSpec("r00", PROMPT, 3), RequestSpec("r01", PROMPT, 3, arrival_step=20, params=asked),
                RequestSpec("r02", PROMPT, 3, arrival_step=40))
    return Scenario("resent-prompt-logprobs", "", "default", settings, requests, ("prefix-hit",))


def _cached_tokens(case, scenario):
    result, traces = run_scenario(scenario, case, only="cached-tokens")
    (check,) = [c for c in result.checks if c.check == "cached-tokens"]
    return check, traces["test"]


def test_a_prompt_logprobs_request_is_neither_served_nor_counted(small_case):
    check, test = _cached_tokens(small_case, _resent(prompt_logprobs=True))
    assert check.status == PASS, check.summary
    assert test.requests["r01"].num_cached_tokens == 0 and test.requests["r02"].num_cached_tokens == 8
    assert test.occupancy["prefix_cache_queries"] == 2 * len(PROMPT)  # r00 and r02 looked up, r01 not
    plain, test = _cached_tokens(small_case, _resent(prompt_logprobs=False))  # the control: r01 hits
    assert plain.status == PASS and test.requests["r01"].num_cached_tokens == 8
    assert test.occupancy["prefix_cache_queries"] == 3 * len(PROMPT)


def test_an_engine_serving_a_prompt_logprobs_request_from_the_cache_fails(small_case):
    """The trace of a run where r01 looked the prompt up (the control's), judged as the scenario that asks
    r01 for prompt logprobs: its hit and the lookup the counters report are both wrong there."""
    _, served = _cached_tokens(small_case, _resent(prompt_logprobs=False))
    result = check_cached_tokens(_resent(prompt_logprobs=True), served)
    assert result.status == FAIL, result.summary
    assert "request r01: 8 cached tokens, expected 0" in result.summary
