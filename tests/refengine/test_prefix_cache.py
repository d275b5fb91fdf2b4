"""Prefix caching for the hybrid model: the pools, the chunk rules, and the reference engine with the
cache on against the same engine with it off (tokens, acceptance, logits digests), hits at the
ceiling the mode allows for the prompt geometry, eviction, preemption of shared blocks, aborts."""

from __future__ import annotations

import os
import random

import pytest
import torch

from refengine import LLM, SamplingParams
from refengine.config import CacheConfig, ConfigError, EngineConfig
from refengine.drafters import ScriptedDrafter
from refengine.prefix_cache import BlockPool, CheckpointPool, PrefixCache, geometry

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BS = 4  # block size of the engine tests
VOCAB = 256


# ---- the pools and the chunk rules ----------------------------------------------------------------

def test_block_pool_refcounts_and_lru_eviction():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.publish(a, b"ka") and pool.publish(b, b"kb")
    assert not pool.publish(b, b"kc"), "a block has one key"
    pool.take([a])  # a second holder
    pool.free([a, b])
    assert pool.refs(a) == 1 and pool.num_used == 1 and pool.num_free == 2  # b is cached, evictable
    (c,) = pool.allocate(1)  # the never-cached block goes first
    assert c not in (a, b) and pool.lookup(b"kb") == b
    (d,) = pool.allocate(1)  # then the LRU cached one, which loses its key
    assert d == b and pool.lookup(b"kb") is None
    assert pool.allocate(1) is None, "a referenced block is never evicted"
    pool.free([a, c, d])
    assert pool.num_used == 0 and pool.lookup(b"ka") == a
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([c])


def test_checkpoint_pool_is_lru_and_keyed_once():
    ck = CheckpointPool(first_slot=10, num_slots=2)
    s1, s2 = ck.reserve(b"x"), ck.reserve(b"y")
    assert {s1, s2} == {10, 11} and ck.reserve(b"x") is None
    assert ck.lookup(b"x") == s1  # touches x: y is now the least recently used
    assert ck.reserve(b"z") == s2 and not ck.has(b"y")


def test_checkpoint_pool_holds_staging_slots_and_swaps_them_in():
    ck = CheckpointPool(first_slot=10, num_slots=2, num_staging=2)  # checkpoints 10, 11; staging 12, 13
    assert ck.reserve(b"w") == 10 and ck.reserve(b"x") == 11  # the pool is full
    a, b = ck.hold(), ck.hold()
    assert {a, b} == {12, 13} and ck.hold() is None and ck.num_held == 2
    assert ck.has(b"w") and ck.has(b"x"), "holding never evicts a checkpoint"
    assert ck.keep(a, b"y") and ck.lookup(b"y") == a and not ck.has(b"w"), "keyed, w (the LRU one) makes room"
    assert ck.num_used == 2 and ck.num_held == 1
    assert ck.hold() == 10, "the slot w gave up is a staging slot now"
    assert not ck.keep(b, b"x"), "a key has one checkpoint: the held slot is freed"
    assert ck.lookup(b"x") == 11 and ck.hold() == b
    ck.release(b)
    with pytest.raises(RuntimeError, match="released but not held"):
        ck.release(b)
    assert ck.num_held == 1


def _cache(mode):
    return PrefixCache(BlockPool(8), CheckpointPool(0, 4), block_size=4, mode=mode, lookahead=0)


@pytest.mark.parametrize("mode,nc,num_new,total,want", [
    ("all", 0, 10, 10, 4), ("all", 4, 6, 10, 4), ("all", 8, 2, 10, 2), ("all", 5, 9, 20, 3),
    ("align", 0, 10, 10, 8),  # stops at the last boundary of the prompt
    ("align", 8, 2, 10, 2),  # the tail after it runs unclipped
    ("align", 0, 7, 30, 4),  # a budget-limited chunk ends on the grid
    ("align", 0, 3, 30, 3),  # shorter than a block: left as it is
    ("align", 0, 12, 12, 8),  # a prompt on the grid stops a block early: (L - 1) // B * B, the longest hit
    ("align", 8, 4, 12, 4),  # then its last block runs (its end is a chunk end on the grid)
    ("align", 0, 11, 11, 8),
    ("align", 2, 20, 30, 2),  # a chunk starting off the grid stops at the next boundary
])
def test_chunk_clipping(mode, nc, num_new, total, want):
    assert _cache(mode).clip(nc, num_new, total) == want


@pytest.mark.parametrize("nc,num_new,total,shared,want", [
    (0, 20, 20, 12, 12),  # a hit fell short of the 12 shared tokens: the chunk stops there
    (12, 8, 20, 12, 4),  # then on to the prompt's last checkpoint
    (0, 20, 20, 14, 12),  # the junction is floored to the grid
    (0, 8, 20, 12, 8),  # a chunk that ends before it is not stretched
    (12, 8, 20, 0, 4),
])
def test_align_chunk_stops_at_the_shared_prefix(nc, num_new, total, shared, want):
    assert _cache("align").clip(nc, num_new, total, shared) == want
    assert _cache("all").clip(nc, num_new, total, shared) == min(num_new, (nc // 4 + 1) * 4 - nc)


def test_align_last_checkpoint_leaves_the_lookahead_token():
    """With block keys covering one token more (a KV-cached drafter), the longest hit on a resent prompt of
    L tokens is (L - 1) // B * B as without, so that is where the prompt's last checkpoint goes."""
    with_lookahead = PrefixCache(BlockPool(8), CheckpointPool(0, 4), block_size=4, mode="align", lookahead=1)
    assert with_lookahead.clip(0, 12, 12) == 8 and with_lookahead.clip(0, 13, 13) == 12
    assert geometry.last_checkpoint(13, 4, 0) == 12 and geometry.last_checkpoint(12, 4, 3) == 8


def test_geometry_reached_boundaries_and_their_columns():
    assert geometry.reached(4, 4, 4, True, 4) == [(8, 0)]  # a chunk ending on the grid holds its end
    assert geometry.reached(4, 6, 6, True, 4) == []  # the chunk went past: its state is gone
    assert geometry.reached(6, 4, 2, False, 4) == [(8, 1)]  # verify row over 6..9 kept 2: after token 7
    assert geometry.reached(6, 4, 1, False, 4) == []  # kept 1: the boundary's token was rejected
    assert geometry.reached(7, 6, 6, False, 4) == [(8, 0), (12, 4)]  # two boundaries in one verify step
    assert geometry.reached(8, 4, 4, False, 4) == [(12, 3)]


def test_geometry_column_table_is_the_column_rule():
    """The device copy's table gives, for a start's offset in its block, the column of each boundary:
    the same columns ``reached`` gives on the host."""
    for bs in (1, 2, 4, 8):
        table = geometry.column_table(bs, 3)
        for start in range(3 * bs):
            kept = 3 * bs
            want = [c for _, c in geometry.reached(start, kept, kept, False, bs)][:3]
            assert table[start % bs] == want
    assert geometry.num_boundaries(3, 8, 4) == 2 and geometry.num_boundaries(4, 7, 4) == 0


def test_settings_are_validated():
    assert CacheConfig(enable_prefix_caching=True).mamba_cache_mode == "align"
    assert CacheConfig().mamba_cache_mode == "none"
    with pytest.raises(ConfigError, match="mamba_cache_mode must be one of .* got 'bogus'"):
        CacheConfig(enable_prefix_caching=True, mamba_cache_mode="bogus")
    with pytest.raises(ConfigError, match="mamba_cache_mode='all' needs enable_prefix_caching=True"):
        CacheConfig(mamba_cache_mode="all")
    with pytest.raises(ConfigError, match="'none' cannot serve enable_prefix_caching=True"):
        CacheConfig(enable_prefix_caching=True, mamba_cache_mode="none")
    with pytest.raises(ConfigError, match="enable_prefix_caching must be True or False, got 1"):
        CacheConfig(enable_prefix_caching=1)
    config = EngineConfig(engine="async", cache=CacheConfig(enable_prefix_caching=True))
    assert config.cache.enable_prefix_caching and config.num_staged_checkpoints > 0
    with pytest.raises(ConfigError, match="recurrent_prefill_chunked=True"):
        EngineConfig(recurrent_prefill_chunked=True, cache=CacheConfig(enable_prefix_caching=True))


# ---- the engine ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("next-tiny"))


def run(ckpt, waves, *, cache_mode=None, max_tokens=12, block_size=BS, **kw):
    """Run ``waves`` (lists of prompts; a wave is submitted once the previous one finished). A wave given as
    a callable builds its prompts from the outputs so far (multi-turn). Returns outputs, records, llm."""
    records = []
    if cache_mode is not None:
        kw.update(enable_prefix_caching=True, mamba_cache_mode=cache_mode)
    llm = LLM(model=ckpt, block_size=block_size, observer=records.append, **kw)
    outs = []
    for wave in waves:
        prompts = wave(outs) if callable(wave) else wave
        outs += llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert llm.engine.pools_empty(), "a KV block, state slot or request leaked"
    return outs, records, llm


def truth_of(llm, kw: dict) -> dict:
    """``kw`` with a scripted drafter (``drafter="scripted"``) drafting from ``llm``'s truth, the truth an
    earlier run on the same weights computed (a request's greedy output is a function of the request),
    instead of a second truth engine computing it again."""
    if kw.get("drafter") != "scripted":
        return kw
    truth = llm.config.speculative.drafter.truth
    return {**kw, "drafter": ScriptedDrafter(kw["num_speculative_tokens"], llm.model_config.vocab_size,
                                             truth=truth)}


def digests(records):
    """(request index in submission order, last position of the row) -> verify logits digest."""
    out = {}
    for rec in records:
        for r in rec.rows:
            if r.logits_digest is not None:
                out[(r.request_id, r.positions[-1])] = r.logits_digest
    return out


def ceiling(prompt, sources, mode, lookahead):
    """The hit the mode allows ``prompt`` from earlier finished single-chunk ``sources`` (RequestOutputs).

    A source published the state at: ``all`` every boundary of its committed tokens, ``align`` its
    prompt's last checkpoint ((L - max(1, lookahead)) // B * B), its prompt's end when that is on the
    grid (its prefill stopped at both), and every boundary after its prompt. Its committed tokens end one
    before its last output token (its last step publishes too). A hit must leave the last prompt token
    to compute and match the source through the block's key (``lookahead`` tokens more).
    """
    best = 0
    for src in sources:
        tokens = src.prompt_token_ids + src.token_ids
        n = len(src.prompt_token_ids)
        stops = {(n - max(1, lookahead)) // BS * BS, n - n % BS if n % BS == 0 else -1}
        common = next(
            (i for i, (x, y) in enumerate(zip(tokens, prompt)) if x != y), min(len(tokens), len(prompt))
        )
        for b in range(BS, len(tokens), BS):
            kept = mode == "all" or b in stops or b > n
            if kept and b <= len(prompt) - 1 and b + lookahead <= common:
                best = max(best, b)
    return best


def prompts(rng, n):
    return [rng.randrange(VOCAB) for _ in range(n)]


CASES = [("all", 0, "mtp"), ("align", 0, "mtp"), ("all", 3, "mtp"), ("align", 1, "scripted"),
         ("all", 3, "scripted")]


@pytest.mark.parametrize("mode,k,drafter", CASES)
def test_cache_on_equals_cache_off_at_the_ceiling(ckpt, mode, k, drafter):
    """A shared system prompt, lengths at block boundary -1/0/+1, and a multi-turn follow-up."""
    rng = random.Random(7)
    system = prompts(rng, 3 * BS)
    first = system + prompts(rng, 3)
    second = [system + prompts(rng, n) for n in (BS - 1, BS, BS + 1)] + [
        system[: 2 * BS + d] for d in (-1, 0, 1)
    ]
    waves = [[first], second, lambda outs: [first + outs[0].token_ids + prompts(random.Random(1), 2)]]
    kw = {"num_speculative_tokens": k, "drafter": drafter}
    off, off_rec, off_llm = run(ckpt, waves, **kw)
    on, on_rec, llm = run(ckpt, waves, cache_mode=mode, **truth_of(off_llm, kw))
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.acceptance for o in on] == [o.acceptance for o in off]
    d_on, d_off = digests(on_rec), digests(off_rec)
    assert d_on.items() <= d_off.items(), "a restored state changed a logit"
    lookahead = 1 if (k and drafter == "mtp") else 0
    expected = [0] + [ceiling(o.prompt_token_ids, on[:1], mode, lookahead) for o in on[1:-1]]
    expected.append(ceiling(on[-1].prompt_token_ids, on[:-1], mode, lookahead))
    assert [o.num_cached_tokens for o in on] == expected
    assert any(expected), "the geometry allows no hit: the test proves nothing"
    occ = llm.occupancy()
    assert occ.prefix_cache_hits == sum(expected) and occ.prefix_cache_queries == sum(
        len(o.prompt_token_ids) for o in on
    )
    # the hit rows start from the restored state: a prefill with initial state at the hit
    hit_rows = [r for rec in on_rec for r in rec.rows if r.num_computed_tokens and r.kind == "prefill"
                and r.num_computed_tokens % BS == 0]
    assert all(r.has_initial_state for r in hit_rows)


def test_hit_leaving_fewer_than_one_plus_k_tokens(ckpt):
    k = 3
    rng = random.Random(3)
    base = prompts(rng, 4 * BS)
    waves = [[base], [base[: 3 * BS + 1], base[: 3 * BS + 2]]]
    kw = {"num_speculative_tokens": k, "drafter": "scripted"}
    off, _, off_llm = run(ckpt, waves, **kw)
    on, rec, _ = run(ckpt, waves, cache_mode="all", **truth_of(off_llm, kw))
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.num_cached_tokens for o in on[1:]] == [3 * BS, 3 * BS]
    short = [r for s in rec for r in s.rows if r.num_computed_tokens == 3 * BS and r.query_len < 1 + k]
    assert short and all(r.kind == "prefill" and r.has_initial_state for r in short)


def test_eviction_under_a_tiny_pool(ckpt):
    """More distinct prefixes than the pools hold: LRU eviction keeps outputs exact and pools empty."""
    rng = random.Random(5)
    systems = [prompts(rng, 3 * BS) for _ in range(4)]
    waves = [[s + prompts(rng, 2) for s in systems], [s + prompts(rng, 3) for s in systems]]
    kw = {"num_kv_blocks": 16, "max_model_len": 40, "max_num_seqs": 2}
    off, _, _ = run(ckpt, waves, **kw)
    on, _, llm = run(ckpt, waves, cache_mode="all", num_state_checkpoints=3, **kw)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    hits = [o.num_cached_tokens for o in on[4:]]
    assert 0 in hits, "nothing was evicted: the test proves nothing"
    assert llm.engine.caches.states and llm.engine.core.scheduler.prefix.checkpoints.num_used == 3


def test_preempting_a_request_whose_blocks_are_shared(ckpt):
    rng = random.Random(9)
    system = prompts(rng, 4 * BS)
    waves = [[system + prompts(rng, 1)], [system + prompts(rng, n) for n in (2, 3, 5, 6)]]
    kw = {
        "num_kv_blocks": 20,
        "max_model_len": 60,
        "max_num_seqs": 4,
        "num_speculative_tokens": 2,
        "drafter": "scripted",
    }
    off, _, off_llm = run(ckpt, waves, max_tokens=30, **kw)
    on, _rec, _ = run(ckpt, waves, max_tokens=30, cache_mode="align", **truth_of(off_llm, kw))
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert sum(o.num_preemptions for o in on[1:]) > 0, "nothing was preempted: the test proves nothing"
    assert all(o.num_cached_tokens == 4 * BS for o in on[1:])


def test_abort_of_a_request_sharing_blocks(ckpt):
    rng = random.Random(11)
    system = prompts(rng, 3 * BS)
    others = [system + prompts(rng, n) for n in (2, 5)]
    base, _, _ = run(ckpt, [[system + [1]], others], cache_mode="all")
    llm = LLM(model=ckpt, block_size=BS, enable_prefix_caching=True, mamba_cache_mode="all")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    llm.generate([system + [1]], params)
    for i, p in enumerate(others):
        llm.add_request(f"o{i}", p, params)
    llm.add_request("victim", system + [9, 9], params)
    for _ in range(3):
        llm.step()
    assert llm.abort("victim").finish_reason == "abort"
    done = {}
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step())
    assert [done[f"o{i}"].token_ids for i in range(2)] == [o.token_ids for o in base[1:]]
    assert llm.engine.pools_empty()


def test_generate_cli_flags(capsys):
    from refengine.tools.cli import main

    ids = ",".join(str(i) for i in range(1, 21))
    assert main(["generate", "--prompt-ids", ids, "--max-tokens", "2", "--enable-prefix-caching",
                 "--mamba-cache-mode", "all"]) == 0
    assert "prefix cache: 0 of 20 looked-up tokens hit" in capsys.readouterr().out
    assert (
        main(["generate", "--prompt-ids", "1,2", "--enable-prefix-caching", "--mamba-cache-mode", "bogus"])
        == 2
    )
    assert (
        "--mamba-cache-mode must be one of ('none', 'align', 'all') or None, got 'bogus'"
        in capsys.readouterr().err
    )
    assert main(["generate", "--prompt-ids", "1,2", "--mamba-cache-mode", "all"]) == 2
    assert "--mamba-cache-mode all needs --enable-prefix-caching" in capsys.readouterr().err


def test_conformance_settings_reach_the_engine_under_test_only():
    from conformance.engines import RunSpec, load_engine, reference_adapter
    from conformance.workloads.scenario import EngineSettings

    s = EngineSettings(enable_prefix_caching=True, mamba_cache_mode="all", block_size=BS)
    assert "prefix-caching/all" in s.describe() and not s.plain().enable_prefix_caching
    spec = RunSpec(None, s, VOCAB, lambda rec: None)
    assert load_engine("reference").build(spec).config.cache.mamba_cache_mode == "all"
    assert not reference_adapter().build(spec).config.cache.enable_prefix_caching
    with pytest.raises(ValueError, match="mamba_cache_mode must be one of .* got 'bogus'"):
        EngineSettings(enable_prefix_caching=True, mamba_cache_mode="bogus")


def _caches_with(specs, num_slots, k):
    """A ``ModelCaches`` holding the state tensors ``specs`` (layer -> RecurrentState) declare, the way a
    model whose layers declared them would (no model needed)."""
    from refengine.cache import ModelCaches

    caches = ModelCaches.__new__(ModelCaches)
    caches.num_speculative_tokens, caches.kv = k, {}
    caches.states = {i: s.allocate(num_slots, torch.float32, "cpu") for i, s in specs.items()}
    caches.checkpoint_kinds = {i: s.checkpoint for i, s in specs.items()}
    for tensors in caches.states.values():
        for t in tensors:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel())))
    return caches


def test_checkpoints_follow_each_state_tensors_declared_kind():
    """A second recurrent mixer (Mamba2: a conv window [C, W-1+K] and a per-slot state [H, P, N]) declares
    its state and is checkpointed through the same path as GDN's, on the host and on the device alike."""
    from refengine.model.cache_specs import SLOT, WINDOW, RecurrentState

    k, w1 = 2, 3  # K, W-1
    specs = {0: RecurrentState(((5, w1 + k), (2, 3, 4)), (False, True), (WINDOW, SLOT)),  # GDN-like
             1: RecurrentState(((2, 3, 4), (6, w1 + k)), (True, False), (SLOT, WINDOW))}  # another order
    host, device = _caches_with(specs, 12, k), _caches_with(specs, 12, k)
    slots = [1, 2, 3]  # s_0..s_K of one request
    copies = [(column, 6 + column) for column in range(k + 1)]  # (column, checkpoint slot)
    for column, dst in copies:
        host.save_checkpoint(slots, column, dst)
    col = torch.tensor([c for c, _ in copies])
    device.save_checkpoints(torch.full_like(col, slots[0]), col, torch.tensor([slots[c] for c, _ in copies]),
                            torch.tensor([d for _, d in copies]))
    for layer, tensors in host.states.items():
        for t, kind, other in zip(tensors, specs[layer].checkpoint, device.states[layer]):
            for column, dst in copies:
                want = t[slots[0], ..., column: column + w1] if kind == WINDOW else t[slots[column]]
                got = t[dst, ..., :w1] if kind == WINDOW else t[dst]
                assert torch.equal(got, want), f"layer {layer} {kind}: column {column}"
                assert torch.equal(other[dst], t[dst]), "the device copy differs from the host copy"
    host.restore_checkpoint(7, 9)
    assert all(torch.equal(t[9], t[7]) for ts in host.states.values() for t in ts)
    with pytest.raises(ValueError, match="checkpoint kind 'conv'"):
        RecurrentState(((5, 4),), (False,), ("conv",))


# ---- where vLLM hits, the cache hits: the three geometries it used to miss ---------------------------

# the async engine's counts are held to the reference's in the default tier (test_prefix_cache_async.py)
ASYNC_ENGINE = {"engine": "async", "graph_mode": "full_and_piecewise"}
ENGINES = [pytest.param({}, id="reference"), pytest.param(ASYNC_ENGINE, id="async", marks=pytest.mark.slow)]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_prompt_on_the_grid_sent_twice_hits_all_but_its_last_block(ckpt, engine):
    """align, B=4, K=0: a 12-token prompt's prefill stops at (12 - 1) // 4 * 4 = 8 as well as at 12, so
    the same prompt sent again hits 8 tokens (the split of vLLM 0.32+; 0 with a split at L - L % B)."""
    prompt = prompts(random.Random(21), 3 * BS)
    waves = [[prompt], [prompt]]
    off, _, _ = run(ckpt, waves, max_tokens=4, **engine)
    on, _, _ = run(ckpt, waves, cache_mode="align", max_tokens=4, **engine)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.num_cached_tokens for o in on] == [0, 2 * BS]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_sibling_hits_where_an_earlier_one_stopped_at_the_shared_prefix(ckpt, engine):
    """align, B=4, K=0: X+A, X+B, X+C with |X| = 12, one after another. X+A leaves no state at 12 (its
    prompt's checkpoint is at 16); X+B shares X's blocks but gets no hit, so its prefill stops at the end
    of what it shares (12) and leaves the state there: X+C hits 12."""
    rng = random.Random(23)
    x = prompts(rng, 3 * BS)
    waves = [[x + prompts(rng, 6)] for _ in range(3)]
    off, _, _ = run(ckpt, waves, max_tokens=4, **engine)
    on, records, _ = run(ckpt, waves, cache_mode="align", max_tokens=4, **engine)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.num_cached_tokens for o in on] == [0, 0, 3 * BS]
    second = [r for rec in records for r in rec.rows
              if r.request_id == on[1].request_id and r.kind == "prefill"]
    assert second[0].num_computed_tokens + second[0].query_len == 3 * BS, "the junction stop"


@pytest.mark.parametrize("engine", ENGINES)
def test_a_next_turn_hits_the_blocks_of_the_last_step_with_an_mtp_drafter(ckpt, engine):
    """B=4, K=3 with MTP, multi-turn: an 11-token prompt and 6 outputs leave 16 committed tokens; only the
    request's last verify step reaches 16, and its drafter KV is written there too, so the next turn (its
    prompt, outputs and a new message) hits 16, not 12."""
    rng = random.Random(25)
    first = prompts(rng, 11)
    waves = [[first], lambda outs: [first + outs[0].token_ids + prompts(random.Random(2), 3)]]
    kw = {"num_speculative_tokens": 3, "drafter": "mtp", "max_tokens": 6, **engine}
    off, _, _ = run(ckpt, waves, **kw)
    on, _, _ = run(ckpt, waves, cache_mode="align", **kw)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.acceptance for o in on] == [o.acceptance for o in off]
    assert [o.num_cached_tokens for o in on] == [0, 4 * BS]


@pytest.mark.slow
def test_the_bench_counts_every_prompt_token_it_looks_up(ckpt):
    """``python -m refengine.prefix_cache.bench``: its queried tokens are the workload's prompt tokens, and
    the shared-prefix workload hits."""
    from refengine.prefix_cache import bench

    hits, queries = bench.measure(ckpt, "shared-prefix", "align", 0, BS, "reference")
    waves = bench.shared_prefix(random.Random(0), VOCAB)
    assert queries == sum(len(p) for wave in waves for p in wave) and 0 < hits < queries
