"""The reference engine end to end: transformers parity, lossless speculation, chunking, preemption,
dirty recycled slots and pool accounting."""

from __future__ import annotations

import os

import pytest
import torch

from refengine import LLM, SamplingParams
from refengine.drafters import ScriptedDrafter
from tests.helpers.checkpoints import load_hf_model, write_checkpoint
from tests.helpers.oracle import hf_generate, hf_greedy_loop

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PRESETS = ["next-tiny", "next-gqa4-untied", "qwen35-tiny", "next-odd-dims"]
PARITY_LENGTHS = [1, 3, 17, 40, 130]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {name: str(write_checkpoint(root / name, name)) for name in PRESETS}


def prompts_of(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(ckpt, prompts, max_tokens=32, **kw):
    llm = LLM(model=ckpt, **kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert llm.engine.pools_empty(), "KV blocks or state slots leaked"
    return [o.token_ids for o in outs], outs, llm


@pytest.mark.parametrize("preset", [PRESETS[0], PRESETS[2], *(pytest.param(p, marks=pytest.mark.slow)
                                                               for p in (PRESETS[1], PRESETS[3]))])
def test_transformers_parity(checkpoints, preset):
    """All prompts in one call (so they share batches) equal transformers one prompt at a time."""
    ckpt = checkpoints[preset]
    hf = load_hf_model(ckpt)
    prompts = prompts_of(PARITY_LENGTHS, hf.config.vocab_size, seed=len(preset))
    ours, _, _ = greedy(ckpt, prompts, max_tokens=32)
    for prompt, got in zip(prompts, ours):
        ref = hf_greedy_loop(hf, prompt, 32)
        assert got == ref, f"prompt of {len(prompt)} tokens: engine {got} != transformers {ref}"
        if len(prompt) <= 128:  # see tests/helpers/oracle.py
            assert got == hf_generate(hf, prompt, 32), (
                f"prompt of {len(prompt)} tokens differs from generate()"
            )


@pytest.mark.parametrize("k", [1, 3, *(pytest.param(k, marks=pytest.mark.slow) for k in (2, 4))])
def test_mtp_speculation_is_lossless(checkpoints, k):
    ckpt = checkpoints["next-tiny"]
    prompts = prompts_of([1, 3, 5, 17, 40], 256, seed=7)
    plain, _, _ = greedy(ckpt, prompts)
    spec, outs, _ = greedy(ckpt, prompts, num_speculative_tokens=k)
    assert spec == plain
    for o in outs:
        assert o.acceptance and all(d == k and 0 <= a <= k for d, a in o.acceptance)
        assert o.num_draft_tokens == k * len(o.acceptance)


@pytest.mark.parametrize("k", [3, *(pytest.param(k, marks=pytest.mark.slow) for k in (1, 4))])
def test_scripted_drafter_is_lossless_and_reaches_every_count(checkpoints, k):
    ckpt = checkpoints["qwen35-tiny"]
    prompts = prompts_of([1, 2, k + 1, k + 2, 17, 33], 256, seed=3)
    plain, _, _ = greedy(ckpt, prompts, max_tokens=40)
    spec, outs, llm = greedy(ckpt, prompts, max_tokens=40, num_speculative_tokens=k, drafter="scripted")
    assert spec == plain
    drafter = llm.engine.drafter
    seen = set()
    for o in outs:
        committed = 1  # the prefill's sampled token; each verify step then commits accepted + 1
        for drafted, accepted in o.acceptance:
            assert drafted == k
            assert accepted == drafter.num_correct(o.request_id, committed), (
                "acceptance differs from the script"
            )
            committed += accepted + 1
            seen.add(accepted)
    assert seen == set(range(k + 1)), f"accepted counts seen: {sorted(seen)}"


def test_the_scripted_truth_runs_the_added_requests_together_each_as_it_would_run_alone(monkeypatch):
    """The scripted drafter's truth source (refengine.llm.GreedyTruth) runs every request added before
    the first truth is asked for in one reference-engine run; each gets the greedy output it gets alone."""
    import refengine.llm
    from refengine.request import Request

    runs = []
    run = refengine.llm.GreedyTruth._run
    monkeypatch.setattr(refengine.llm.GreedyTruth, "_run",
                        lambda self, reqs: runs.append(len(reqs)) or run(self, reqs))
    prompts = [[5, 6, 7], [9, 10], [5, 6, 7], [40, 41, 42, 43, 44]]
    params = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=9, min_tokens=9),
              SamplingParams(max_tokens=6),
              SamplingParams(max_tokens=5, bad_words=["ab"], logit_bias={3: 4.0})]
    llm = LLM(engine="async", num_speculative_tokens=2, drafter="scripted")
    llm.generate(prompts, params)
    assert runs == [4]  # one run for the four requests (the repeated one made once)
    truth = llm.config.speculative.drafter.truth
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        alone = refengine.llm.GreedyTruth(llm.config, llm.engine.model, llm.model_config, llm.tokenizer)
        req = Request(f"r{i}", prompt, p, 0)
        assert truth(req) == alone(req) and len(alone(req)) >= p.max_tokens
    assert runs == [4, 1, 1, 1, 1]  # each alone; nothing run again for the batch


@pytest.mark.parametrize("k", [0, 3])
def test_chunked_prefill_tails_equal_unchunked(checkpoints, k):
    """Budgets that leave prompt tails of 1..K+1 tokens give the unchunked tokens."""
    ckpt = checkpoints["next-tiny"]
    budget = 8
    lengths = [budget + t for t in range(1, k + 2)] + [2 * budget + 1, 3 * budget - 1]
    prompts = prompts_of(lengths, 256, seed=11)
    whole, _, _ = greedy(ckpt, prompts, num_speculative_tokens=k)
    records = []
    chunked, _, _ = greedy(ckpt, prompts, num_speculative_tokens=k, max_num_batched_tokens=max(budget, 1 + k),
                           observer=records.append)
    assert chunked == whole
    tails = {r.query_len for rec in records for r in rec.rows if r.kind == "prefill" and r.has_initial_state}
    assert tails & set(range(1, k + 2)), f"no prompt tail of 1..{k + 1} tokens was scheduled: {sorted(tails)}"


@pytest.mark.parametrize("k", [0, 2])
def test_preemption_under_tiny_kv_pool(checkpoints, k):
    ckpt = checkpoints["next-tiny"]
    prompts = prompts_of([20, 35, 9, 28, 14, 3], 256, seed=5)
    free, _, _ = greedy(ckpt, prompts, max_tokens=40, num_speculative_tokens=k)
    squeezed, outs, _llm = greedy(ckpt, prompts, max_tokens=40, num_speculative_tokens=k, block_size=4,
                                 num_kv_blocks=24, max_model_len=90)
    assert squeezed == free
    assert sum(o.num_preemptions for o in outs) > 0, "the pool was never exhausted: the test proves nothing"
    assert all(o.finish_reason == "length" and len(o.token_ids) == 40 for o in outs)


@pytest.mark.parametrize("k", [0, 2, 3])
def test_dirty_recycled_slots(checkpoints, k):
    """Short new prompts that reuse finished requests' slots (and slots full of garbage) match a fresh
    engine."""
    ckpt = checkpoints["next-tiny"]
    short = prompts_of(range(1, k + 3), 256, seed=13)
    fresh, _, _ = greedy(ckpt, short, max_tokens=12, num_speculative_tokens=k)

    llm = LLM(model=ckpt, num_speculative_tokens=k, max_num_seqs=4)
    llm.generate(prompts_of([30, 25, 40, 12], 256, seed=2), SamplingParams(max_tokens=20, ignore_eos=True))
    records = []
    llm.engine.add_observer(records.append)
    reused = [o.token_ids for o in llm.generate(short, SamplingParams(max_tokens=12, ignore_eos=True))]
    assert reused == fresh
    firsts = [r for rec in records for r in rec.rows if r.num_computed_tokens == 0]
    assert len(firsts) == len(short)
    assert all(r.kind == "prefill" and not r.has_initial_state and r.state_slot_read is None for r in firsts)

    poisoned = LLM(model=ckpt, num_speculative_tokens=k)
    for tensors in poisoned.engine.caches.states.values():  # every recurrent slot holds NaN
        for t in tensors:
            t.fill_(float("nan"))
    got = [o.token_ids for o in poisoned.generate(short, SamplingParams(max_tokens=12, ignore_eos=True))]
    assert got == fresh


def test_short_prompts_mixed_with_running_decodes(checkpoints):
    """New prompts of 1..K+2 tokens arriving while others decode are prefills with zero state."""
    ckpt = checkpoints["next-tiny"]
    k = 3
    records = []
    llm = LLM(model=ckpt, num_speculative_tokens=k, observer=records.append)
    long = prompts_of([24, 30], 256, seed=8)
    short = prompts_of(range(1, k + 3), 256, seed=9)
    fresh, _, _ = greedy(ckpt, short, max_tokens=10, num_speculative_tokens=k)
    for i, p in enumerate(long):
        llm.add_request(f"long-{i}", p, SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(3):
        llm.step()
    for i, p in enumerate(short):
        llm.add_request(f"short-{i}", p, SamplingParams(max_tokens=10, ignore_eos=True))
    done = {}
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step())
    assert [done[f"short-{i}"].token_ids for i in range(len(short))] == fresh
    mixed = [rec for rec in records if {r.kind for r in rec.rows} == {"prefill", "decode"}]
    assert mixed, "short prompts never shared a step with decodes"
    for rec in records:
        for r in rec.rows:
            if r.request_id.startswith("short") and r.num_computed_tokens == 0:
                assert r.kind == "prefill" and not r.has_initial_state


def test_observer_records_state_offsets_and_ids(checkpoints):
    ckpt = checkpoints["next-tiny"]
    k = 3
    records = []
    greedy(ckpt, prompts_of([5, 9], 256), max_tokens=20, num_speculative_tokens=k, drafter="scripted",
           observer=records.append)
    prev_kept: dict[str, int] = {}
    for rec in records:
        for r in rec.rows:
            assert all(0 <= t < 256 for t in r.input_ids + r.drafter_input_ids + r.next_draft_token_ids)
            if r.kind == "decode":
                assert r.state_offset == prev_kept[r.request_id] - 1
                assert r.query_len == 1 + k and len(r.draft_token_ids) == k
            if r.output_token_ids is not None:
                prev_kept[r.request_id] = len(r.output_token_ids)


def test_many_requests_leave_pools_empty(checkpoints):
    ckpt = checkpoints["next-tiny"]
    llm = LLM(model=ckpt, num_speculative_tokens=2, max_num_seqs=8, block_size=4)
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, 256, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 12, (60,), generator=g)
    ]
    params = [
        SamplingParams(max_tokens=int(m), ignore_eos=True) for m in torch.randint(1, 6, (60,), generator=g)
    ]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert llm.engine.pools_empty() and not llm.has_unfinished()


@pytest.mark.parametrize("k", [0, 3])
def test_logits_are_batch_invariant(checkpoints, k):
    """A request's verify logits are bitwise the same alone and in a crowded, chunked batch."""
    ckpt = checkpoints["next-odd-dims"]
    prompts = prompts_of([1, 4, 19, 33, 7, 50, 2], 199, seed=21)

    def digests(prompts_run, **kw):
        records = []
        drafter = ScriptedDrafter(k, 199, "cycle") if k else "mtp"  # a schedule that ignores request ids
        llm = LLM(model=ckpt, num_speculative_tokens=k, drafter=drafter, observer=records.append, **kw)
        outs = llm.generate(prompts_run, SamplingParams(max_tokens=12, ignore_eos=True))
        by_req: dict[str, list[str]] = {}
        for rec in records:
            for r in rec.rows:
                if r.logits_digest is not None:
                    by_req.setdefault(r.request_id, []).append(r.logits_digest)
        return [by_req[o.request_id] for o in outs]

    alone = [digests([p])[0] for p in prompts]
    together = digests(prompts, max_num_batched_tokens=24, max_num_seqs=5)
    assert together == alone
