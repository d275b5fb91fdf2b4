"""The n-gram (prompt lookup) drafter: the lookup's rule, host and device alike, and both engines on it.

It proposes 0..K drafts per request per step, so a request that accepted drafts in one step may
verify none in the next: the async engine still runs 1+K tokens per decode row (fillers past the
drafts), verifies only the device's drafts and reads the state of the last kept token.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refengine import LLM, ConfigError, SamplingParams
from refengine.config import SpeculativeConfig
from refengine.drafters.ngram import FILLER_TOKEN, NgramDrafter, ngram_lookup, ngram_lookup_batch
from tests.refengine.test_async_engine import drive

# ---- the lookup -----------------------------------------------------------------------------------


def by_definition(tokens, lo, hi, k, max_model_len):
    """The rule stated as a search over every (n, start): the longest n-gram, then its earliest match."""
    n_tok = len(tokens)
    found = [(n, s) for n in range(lo, hi + 1) for s in range(n_tok)
             if s + n < n_tok and tokens[s: s + n] == tokens[n_tok - n:]]
    if not found:
        return []
    n = max(n for n, _ in found)
    s = min(s for m, s in found if m == n)
    return tokens[s + n: s + n + max(0, min(k, max_model_len - n_tok))]


def on_device(rows, lo, hi, k, max_model_len, width=None, junk=None):
    """``ngram_lookup_batch`` over ``rows`` padded into one table (what follows a row: ``junk`` ids)."""
    width = width or max(len(r) for r in rows) + 2
    table = torch.full((len(rows), width), -1, dtype=torch.int64)
    if junk is not None:
        table = torch.randint(0, 50, (len(rows), width), generator=torch.Generator().manual_seed(junk))
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    drafts, counts = ngram_lookup_batch(
        table, torch.tensor([len(r) for r in rows], dtype=torch.int32), lo, hi, k, max_model_len
    )
    assert drafts.shape == (len(rows), k) and counts.shape == (len(rows),)
    out = []
    for d, c in zip(drafts.tolist(), counts.tolist()):
        assert all(t == FILLER_TOKEN for t in d[c:]), f"columns past the count hold {d[c:]}, not the filler"
        out.append(d[:c])
    return out


# (tokens, prompt_lookup_min, prompt_lookup_max, K, max_model_len, drafts)
CASES = [
    ([1, 2, 3, 4, 5], 1, 3, 3, 100, []),  # no n-gram occurs twice
    ([7, 8, 9, 7, 8], 2, 2, 3, 100, [9, 7, 8]),  # the match starts at the very first token
    ([5, 1, 2, 1, 2], 2, 2, 3, 100, [1, 2]),  # a match near the end: fewer than K follow it
    ([1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 3, 100, [7, 1, 2]),  # several matches: the earliest wins
    (
        [3, 1, 2, 9, 4, 1, 2, 8, 4, 1, 2],
        2,
        3,
        3,
        100,
        [8, 4, 1],
    ),  # a longer n-gram beats an earlier shorter one
    ([5, 5, 5, 5], 2, 2, 3, 100, [5, 5]),  # a match that overlaps the pattern
    ([1, 2, 3, 4, 2, 3], 2, 3, 4, 100, [4, 2, 3]),  # vLLM's documented example
    ([4, 4], 3, 3, 3, 100, []),  # shorter than prompt_lookup_min + 1: nothing to match
    ([6], 1, 1, 3, 100, []),  # one token: the pattern itself is no match
    ([1, 2, 1, 2, 3, 1, 2], 2, 2, 3, 8, [1]),  # one position left under max_model_len
    ([1, 2, 1, 2, 3, 1, 2], 2, 2, 3, 7, []),  # at max_model_len: nothing
    ([9, 1, 9, 2, 9], 1, 1, 1, 100, [1]),  # K=1
]


@pytest.mark.parametrize("tokens,lo,hi,k,max_len,want", CASES)
def test_lookup_odd_cases_host_and_device(tokens, lo, hi, k, max_len, want):
    assert ngram_lookup(tokens, lo, hi, k, max_len) == want
    assert by_definition(tokens, lo, hi, k, max_len) == want
    assert on_device([tokens], lo, hi, k, max_len) == [want]


def test_device_lookup_of_a_padded_table_matches_row_by_row():
    """Every case in one table, rows of every length, junk after each row's tokens."""
    for lo, hi, k in ((1, 3, 3), (2, 2, 1), (2, 4, 3), (5, 5, 2)):
        rows = [t for t, *_ in CASES] + [[], [3]]
        want = [ngram_lookup(r, lo, hi, k, 12) for r in rows]
        assert on_device(rows, lo, hi, k, 12, width=14, junk=lo * 10 + hi) == want


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=24), min_size=1, max_size=6), st.integers(1, 4),
       st.integers(0, 3), st.integers(1, 4), st.integers(0, 30))
def test_host_and_device_propose_the_same_drafts(rows, lo, extra, k, max_len):
    hi = lo + extra
    want = [by_definition(r, lo, hi, k, max_len) for r in rows]
    assert [ngram_lookup(r, lo, hi, k, max_len) for r in rows] == want
    assert on_device(rows, lo, hi, k, max_len, width=26, junk=len(rows)) == want


# ---- settings -------------------------------------------------------------------------------------


def test_prompt_lookup_defaults_are_vllms():
    def lookup(**kw):
        spec = SpeculativeConfig(3, "ngram", **kw)
        return spec.prompt_lookup_min, spec.prompt_lookup_max

    assert lookup() == (5, 5)
    assert lookup(prompt_lookup_min=2) == (2, 2)
    assert lookup(prompt_lookup_max=4) == (4, 4)
    assert lookup(prompt_lookup_min=1, prompt_lookup_max=3) == (1, 3)
    assert SpeculativeConfig(3, "mtp").prompt_lookup_min is None


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"drafter": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)",
        ),
        (
            {"drafter": "mtp", "prompt_lookup_max": 3},
            "prompt_lookup_max=3: prompt lookup settings apply to drafter='ngram'",
        ),
        ({"drafter": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min must be >= 1, got 0"),
    ],
)
def test_bad_prompt_lookup_settings_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM(num_speculative_tokens=2, **kwargs)


def test_a_drafter_built_by_hand_checks_its_lengths():
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(3\) must be <= prompt_lookup_max \(2\)"):
        NgramDrafter(2, 3, 2, 64)
    with pytest.raises(ValueError, match="prompt_lookup_max must be an int >= 1, got 0"):
        NgramDrafter(2, 1, 0, 64)


# ---- both engines -------------------------------------------------------------------------------------

LOOKUP = {"prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.helpers.checkpoints import write_checkpoint

    return str(write_checkpoint(tmp_path_factory.mktemp("ngram") / "next-tiny", "next-tiny"))


def ngram_workload(seed: int, n: int = 8):
    """Prompts that repeat a short phrase (the lookup hits) and random ones (it mostly misses)."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        length = rng.randint(3, 20)
        if i % 2 == 0:
            phrase = [rng.randrange(256) for _ in range(1 + i % 3)]
            prompt = (phrase * length)[:length]
        else:
            prompt = [rng.randrange(256) for _ in range(length)]
        items.append(
            (i // 2, f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(12, 24), ignore_eos=True))
        )
    return items


def verified(records) -> dict:
    """(verifier output, logits digest) keyed by (request, first position, drafts verified)."""
    return {
        (r.request_id, r.positions[0], tuple(r.draft_token_ids)): (tuple(r.output_token_ids), r.logits_digest)
        for rec in records
        for r in rec.rows
        if r.logits_digest is not None and r.kind == "decode"
    }


def zero_draft_after_accept(acceptance: list[tuple[int, int]]) -> bool:
    return any(a >= 1 and d2 == 0 for (_, a), (d2, _) in itertools.pairwise(acceptance))


@pytest.fixture(scope="module")
def reference_runs(ckpt):
    runs = {}
    plain = drive(LLM(model=ckpt), ngram_workload(0))
    for k in (1, 3):
        records = []
        outs = drive(
            LLM(model=ckpt, num_speculative_tokens=k, drafter="ngram", observer=records.append, **LOOKUP),
            ngram_workload(0),
        )
        runs[k] = outs, records
        assert {r: o.token_ids for r, o in outs.items()} == {r: o.token_ids for r, o in plain.items()}, \
            "n-gram speculation changed the greedy output"
    return runs


@pytest.mark.parametrize(
    "k,graph_mode",
    [(3, "none"), (3, "piecewise"), (3, "full"), (3, "full_and_piecewise"), (1, "none"), (1, "full")],
)
def test_async_equals_reference(ckpt, reference_runs, k, graph_mode):
    ref, ref_records = reference_runs[k]
    acceptance = [o.acceptance for o in ref.values()]
    assert any(zero_draft_after_accept(a) for a in acceptance), "no step with accepted drafts then none"
    if k > 1:
        assert any(0 < d < k for a in acceptance for d, _ in a), "no step with fewer than K drafts but some"
    records = []
    llm = LLM(model=ckpt, engine="async", graph_mode=graph_mode, num_speculative_tokens=k, drafter="ngram",
              observer=records.append, max_num_seqs=4, **LOOKUP)
    got = drive(llm, ngram_workload(0))
    for rid, o in ref.items():
        assert got[rid].token_ids == o.token_ids, (
            f"{rid}: async {got[rid].token_ids} != reference {o.token_ids}"
        )
        assert got[rid].acceptance == o.acceptance, (
            f"{rid}: acceptance {got[rid].acceptance} != {o.acceptance}"
        )
    ours, theirs = verified(records), verified(ref_records)
    assert ours == theirs, "a verify step (same position, same drafts) gave other outputs or logits"
    for rec in records:
        for r in rec.rows:
            assert len(r.next_draft_token_ids) <= k and all(0 <= t < 256 for t in r.next_draft_token_ids)
    if graph_mode in ("full", "full_and_piecewise"):
        full = [rec for rec in records if rec.graph_mode == "full"]
        assert any(rec.num_reqs_padded > len(rec.rows) for rec in full), "no padded FULL replay"
        assert any(not r.draft_token_ids for rec in full for r in rec.rows), (
            "no zero-draft row in a FULL step"
        )


class HidingDrafter(NgramDrafter):
    """The n-gram drafter that proposes one draft fewer than it found, leaving the one it dropped in the
    device's draft column: a row's columns past its count then hold a likely token, not a filler, so
    an engine that verified them would accept some."""

    def lookup(self, tokens: list[int]) -> list[int]:
        return super().lookup(tokens)[:-1]

    def device_proposer(self, ctx):
        proposer = super().device_proposer(ctx)
        propose = proposer.propose

        def propose_one_fewer(d):
            out = propose(d)
            out.num_drafts = (out.num_drafts - 1).clamp(min=0)
            return out

        proposer.propose = propose_one_fewer
        return proposer


@pytest.mark.parametrize("graph_mode", ["none", "full"])
def test_only_the_device_drafts_are_verified(ckpt, graph_mode):
    """Columns past a row's draft count are never compared, whatever they hold."""
    def run(engine, **kw):
        return drive(
            LLM(
                model=ckpt,
                engine=engine,
                num_speculative_tokens=3,
                drafter=HidingDrafter(3, 1, 3, 1024),
                **kw,
            ),
            ngram_workload(1),
        )

    ref, got = run("reference"), run("async", graph_mode=graph_mode)
    assert any(d < 3 for o in ref.values() for d, _ in o.acceptance)
    assert {r: o.acceptance for r, o in got.items()} == {r: o.acceptance for r, o in ref.items()}
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}


def test_preempted_requests_restart_their_lookup_exactly(ckpt):
    """A tiny KV pool preempts requests; a resumed request's device row (tokens, draft count) starts over."""
    kw = dict(num_speculative_tokens=3, drafter="ngram", block_size=4, num_kv_blocks=14, max_model_len=48,
              max_num_seqs=6, **LOOKUP)
    items = [
        (0, rid, prompt, SamplingParams(max_tokens=30, ignore_eos=True))
        for _, rid, prompt, _ in ngram_workload(2)
    ]
    ref_records, records = [], []
    ref = drive(LLM(model=ckpt, observer=ref_records.append, **kw), items)
    got = drive(
        LLM(model=ckpt, engine="async", graph_mode="full_and_piecewise", observer=records.append, **kw), items
    )
    assert any(o.num_preemptions for o in got.values()), "nothing was preempted"
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}
    ours, theirs = verified(records), verified(ref_records)
    shared = ours.keys() & theirs.keys()
    assert len(shared) >= 0.5 * len(theirs) and {key: ours[key] for key in shared} == {
        key: theirs[key] for key in shared
    }


def test_near_max_model_len_at_most_max_model_len_minus_n_minus_1_drafts_are_verified(ckpt):
    """A verify row of a request with N tokens runs N-1 plus its drafts and samples one more under
    max_model_len, so at most max_model_len - N - 1 drafts are verified (vLLM's scheduler trim): the draft
    and acceptance counts agree with vLLM's up to the end, in both engines."""
    assert NgramDrafter(3, 2, 2, 9).lookup([1, 2, 1, 2, 3, 1, 2]) == [1]  # the proposer alone: [1, 2]
    max_len = 24
    items = [(0, f"r{i}", (phrase * 9)[:9], SamplingParams(max_tokens=max_len, ignore_eos=True))
             for i, phrase in enumerate(([5], [7, 8], [9, 10, 11]))]
    kw = dict(num_speculative_tokens=3, drafter="ngram", max_model_len=max_len, block_size=4, **LOOKUP)
    ref = drive(LLM(model=ckpt, **kw), items)
    got = drive(LLM(model=ckpt, engine="async", graph_mode="full_and_piecewise", **kw), items)
    capped = 0
    for rid, out in ref.items():
        assert out.acceptance == got[rid].acceptance and out.token_ids == got[rid].token_ids
        n = len(out.prompt_token_ids) + 1  # the prefill's sampled token
        for drafted, accepted in out.acceptance:
            assert drafted <= max_len - n - 1, f"{rid}: {drafted} drafts verified at {n} of {max_len} tokens"
            capped += drafted == max_len - n - 1 < 3
            n += accepted + 1
        assert len(out.prompt_token_ids) + len(out.token_ids) == max_len
    assert capped, "no verify step ran near max_model_len with the lookup matching: the test proves nothing"
