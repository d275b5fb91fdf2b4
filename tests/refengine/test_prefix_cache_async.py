"""Prefix caching in the async engine.

With the cache on, the async engine equals the reference engine with the cache off (tokens,
acceptance, logits digests), hits exactly as often as the reference engine with the cache on, and
publishes the same KV blocks and recurrent checkpoints bit for bit (so no checkpoint holds a rejected
draft's state or an optimistic count's), for both modes, K in {0, 1, 3}, both drafters and every
graph mode, with copies delayed and the hazard checker on as the conformance adapter runs it.
Preemption of shared blocks, eviction, aborts in flight and faults leave every pool empty, held
checkpoint slots included.
"""

from __future__ import annotations

import random

import pytest
import torch

from refengine import LLM, SamplingParams
from tests.refengine.test_faults import InjectedFault, fail_once
from tests.refengine.test_prefix_cache import BS, digests, prompts, run, truth_of

GRAPH_MODES = ("none", "piecewise", "full", "full_and_piecewise")
SPECULATION = ((0, "mtp"), (1, "mtp"), (3, "mtp"), (1, "scripted"), (3, "scripted"))
# (mode, K, drafter, graph mode, delay copies and check hazards)
DEFAULT_CASES = [("all", 0, "mtp", "none", False), ("align", 3, "mtp", "full", True),
                 ("all", 3, "scripted", "full_and_piecewise", True),
                 ("align", 1, "scripted", "piecewise", False)]
SLOW_CASES = [(m, k, d, g, True) for m in ("all", "align") for k, d in SPECULATION for g in GRAPH_MODES
              if (m, k, d, g, True) not in DEFAULT_CASES]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("next-tiny"))


def ceiling_waves():
    """A shared system prompt, lengths at block boundary -1/0/+1, then a multi-turn follow-up whose hit
    reaches into the first request's outputs (states published by verify steps)."""
    rng = random.Random(7)
    system = prompts(rng, 3 * BS)
    first = system + prompts(rng, 3)
    second = [system + prompts(rng, n) for n in (BS - 1, BS, BS + 1)]
    second += [system[: 2 * BS + d] for d in (-1, 0, 1)]
    return [[first], second, lambda outs: [first + outs[0].token_ids + prompts(random.Random(1), 2)]]


@pytest.fixture(scope="module")
def reference(ckpt):
    """(mode, K, drafter) -> the reference engine's (cache-off, cache-on) runs, each made once."""
    runs = {}

    def get(mode, k, drafter):
        if (mode, k, drafter) not in runs:
            kw = {"num_speculative_tokens": k, "drafter": drafter}
            off = run(ckpt, ceiling_waves(), **kw)
            on = run(ckpt, ceiling_waves(), cache_mode=mode, **truth_of(off[2], kw))
            runs[mode, k, drafter] = (off, on)
        return runs[mode, k, drafter]

    return get


def published(llm) -> tuple[dict, dict]:
    """key -> the checkpoint's state tensors (every recurrent layer: the W-1 window columns, the
    recurrent state), and key -> the published KV block's entries (every attention layer, the drafter's)."""
    engine = llm.engine
    prefix, k = engine.core.scheduler.prefix, engine.config.speculative.num_speculative_tokens
    states = {}
    for key, slot in prefix.checkpoints.cached().items():
        states[key] = [t for conv, *rest in engine.caches.states.values()
                       for t in (conv[slot, :, : conv.shape[2] - k], *(r[slot] for r in rest))]
    blocks = {key: [t[block] for kv in engine.caches.kv.values() for t in kv]
              for key, block in prefix.kv_pool.cached().items()}
    return states, blocks


def assert_same_published(got, want) -> None:
    for kind, a, b in zip(("checkpoint", "KV block"), published(got), published(want)):
        assert a.keys() == b.keys(), f"the engines published different {kind} keys"
        for key in a:
            assert all(torch.equal(x, y) for x, y in zip(a[key], b[key])), f"a published {kind} differs"


def check_async(ckpt, reference, mode, k, drafter, graph_mode, checked):
    (off, off_rec, _), (ref_on, _, ref_llm) = reference(mode, k, drafter)
    kw = truth_of(ref_llm, {"num_speculative_tokens": k, "drafter": drafter})  # the reference run's truth
    on, on_rec, llm = run(ckpt, ceiling_waves(), cache_mode=mode, engine="async", graph_mode=graph_mode,
                          delay_copies=checked, hazard_check=checked, **kw)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.acceptance for o in on] == [o.acceptance for o in off]
    assert digests(on_rec).items() <= digests(off_rec).items(), "a restored state changed a logit"
    assert [o.num_cached_tokens for o in on] == [o.num_cached_tokens for o in ref_on]
    assert on[-1].num_cached_tokens > len(on[0].prompt_token_ids), "no hit reached into the outputs"
    assert llm.occupancy().prefix_cache_hits == ref_llm.occupancy().prefix_cache_hits
    assert_same_published(llm, ref_llm)
    assert llm.engine.stream.num_host_waits <= llm.engine.stats.steps, "a restore or a publish waited"


@pytest.mark.parametrize("mode,k,drafter,graph_mode,checked", DEFAULT_CASES)
def test_async_cache_on_equals_reference(ckpt, reference, mode, k, drafter, graph_mode, checked):
    check_async(ckpt, reference, mode, k, drafter, graph_mode, checked)


@pytest.mark.slow
@pytest.mark.parametrize("mode,k,drafter,graph_mode,checked", SLOW_CASES)
def test_async_cache_on_equals_reference_matrix(ckpt, reference, mode, k, drafter, graph_mode, checked):
    check_async(ckpt, reference, mode, k, drafter, graph_mode, checked)


ASYNC = {"engine": "async", "graph_mode": "full_and_piecewise", "delay_copies": True, "hazard_check": True}


def test_async_two_boundaries_in_one_verify_step(ckpt):
    """Blocks of 2 tokens and K=3: a verify row's 4 tokens can close two blocks, so each row holds P=2
    slots, the p-th for the p-th boundary after its first position."""
    rng = random.Random(17)
    system = prompts(rng, 7)
    first = system + [1, 2, 3]
    waves = [[first], [system + [9], system[:5], system[:6] + [4, 4]],
             lambda outs: [first + outs[0].token_ids + [5, 6]]]
    kw = {"num_speculative_tokens": 3, "drafter": "scripted", "block_size": 2}
    off, off_rec, _ = run(ckpt, waves, **kw)
    ref, _, ref_llm = run(ckpt, waves, cache_mode="all", **kw)
    on, on_rec, llm = run(ckpt, waves, cache_mode="all", **ASYNC, **kw)
    assert llm.engine.prefix.num_columns == 2
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert digests(on_rec).items() <= digests(off_rec).items()
    assert [o.num_cached_tokens for o in on] == [o.num_cached_tokens for o in ref]
    assert on[-1].num_cached_tokens > len(first), "no hit reached into the outputs"
    assert_same_published(llm, ref_llm)


@pytest.mark.slow  # the corpus's prefix-shared-preemption-k3 and pc-preemption-k3 on every default-tier run
def test_async_preempting_a_request_whose_blocks_are_shared(ckpt):
    rng = random.Random(9)
    system = prompts(rng, 4 * BS)
    waves = [[system + prompts(rng, 1)], [system + prompts(rng, n) for n in (2, 3, 5, 6)]]
    kw = {"num_kv_blocks": 20, "max_model_len": 60, "max_num_seqs": 4, "num_speculative_tokens": 2,
          "drafter": "scripted"}
    off, _, _ = run(ckpt, waves, max_tokens=30, **kw)
    on, _, _ = run(ckpt, waves, max_tokens=30, cache_mode="align", **ASYNC, **kw)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert sum(o.num_preemptions for o in on[1:]) > 0, "nothing was preempted: the test proves nothing"
    assert all(o.num_cached_tokens == 4 * BS for o in on[1:])


def test_async_eviction_under_a_tiny_pool(ckpt):
    """More distinct prefixes than the pools hold: the checkpoints evict as the reference engine's do
    (slots held for steps in flight never evict one), so the same requests hit."""
    rng = random.Random(5)
    systems = [prompts(rng, 3 * BS) for _ in range(4)]
    waves = [[s + prompts(rng, 2) for s in systems], [s + prompts(rng, 3) for s in reversed(systems)]]
    kw = {"num_kv_blocks": 16, "max_model_len": 40, "max_num_seqs": 2, "num_speculative_tokens": 3,
          "drafter": "scripted", "cache_mode": "all", "num_state_checkpoints": 6}
    ref, _, _ = run(ckpt, waves, **kw)
    on, _, _ = run(ckpt, waves, **ASYNC, **kw)
    assert [o.token_ids for o in on] == [o.token_ids for o in ref]
    hits = [o.num_cached_tokens for o in on[4:]]
    assert hits == [o.num_cached_tokens for o in ref[4:]]
    assert 0 in hits and any(hits), "nothing was evicted, or nothing hit: the test proves nothing"


def test_async_abort_in_flight_of_a_request_sharing_blocks(ckpt):
    rng = random.Random(11)
    system = prompts(rng, 3 * BS)
    others = [system + prompts(rng, n) for n in (2, 5)]
    base, _, _ = run(ckpt, [[system + [1]], others], cache_mode="all")
    llm = LLM(model=ckpt, block_size=BS, enable_prefix_caching=True, mamba_cache_mode="all", **ASYNC)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    llm.generate([system + [1]], params)
    for i, p in enumerate(others):
        llm.add_request(f"o{i}", p, params)
    llm.add_request("victim", system + [9, 9], params)
    for _ in range(3):
        llm.step()
    assert llm.engine._in_flight(), "the abort must land while a step of the victim is in flight"
    assert llm.abort("victim").finish_reason == "abort"
    done = {}
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step())
    assert [done[f"o{i}"].token_ids for i in range(2)] == [o.token_ids for o in base[1:]]
    assert [done[f"o{i}"].num_cached_tokens for i in range(2)] == [3 * BS, 3 * BS]
    assert llm.engine.pools_empty()


FAULT_SPECULATION = {"num_speculative_tokens": 3, "drafter": "scripted"}


def fault_waves():
    rng = random.Random(13)
    system = prompts(rng, 3 * BS)
    return [[system + [1]], [system + prompts(rng, n) for n in (2, 5, 7)]]


@pytest.fixture(scope="module")
def fault_free(ckpt):
    """The reference engine's outputs of ``fault_waves``, without a cache."""
    return run(ckpt, fault_waves(), **FAULT_SPECULATION)[0]


@pytest.mark.parametrize("stage", ["plan", "process", *(pytest.param(s, marks=pytest.mark.slow)
                                                        for s in ("submitted", "commit"))])
def test_async_fault_frees_held_checkpoints(ckpt, fault_free, stage):
    """A fault drops the steps in flight: their held checkpoint slots are freed, nothing half-written is
    published, and every request still finishes exactly."""
    waves, kw = fault_waves(), FAULT_SPECULATION
    llm = LLM(model=ckpt, block_size=BS, enable_prefix_caching=True, mamba_cache_mode="all", **ASYNC, **kw)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = llm.generate(waves[0], params)
    e = llm.engine
    target, name, after = {"plan": (e.planner, "plan", False), "submitted": (e.runner, "enqueue", True),
                           "process": (e, "process", False), "commit": (e.core, "stop_reason", False)}[stage]
    fail_once(target, name, 3, after=after)
    for i, p in enumerate(waves[1]):
        llm.add_request(f"r{i}", p, params)
    done, faults = {}, 0
    while llm.has_unfinished():
        try:
            done.update((o.request_id, o) for o in llm.step())
        except InjectedFault:
            faults += 1
    assert faults == 1
    got = [o.token_ids for o in outs] + [done[f"r{i}"].token_ids for i in range(3)]
    assert got == [o.token_ids for o in fault_free]
    assert llm.occupancy().checkpoint_slots_held == 0 and llm.engine.pools_empty()
