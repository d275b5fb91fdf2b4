"""The scenario corpus: every workload the suite runs, with a stable id and a one-line purpose.

Each family targets one trigger (the conditions upstream bugs needed, listed in conformance/README.md) and is
instantiated for K in {0, 1, 3} where that matters. Sizes follow the tier: "default" keeps each
scenario to about a second on CPU with a tiny model; "nightly" runs longer outputs and more
requests, plus a few nightly-only soak scenarios.
"""

from __future__ import annotations

from conformance.workloads.draft_model_corpus import draft_model_defs
from conformance.workloads.files import regression_defs
from conformance.workloads.param_corpus import param_defs
from conformance.workloads.sampling_corpus import sampling_defs
from conformance.workloads.scenario import TIERS, EngineSettings, RequestSpec, ScenarioDef
from conformance.workloads.structured_corpus import structured_defs

NIGHTLY = ("nightly",)  # scenarios too slow for the default tier


def _short_prompts(k: int) -> ScenarioDef:
    def build(b):
        lengths = sorted({1, 2, k + 1, k + 2})
        for _ in range(b.size(1, 3)):
            for n in lengths:
                b.add(n, b.size(6, 24))

    return ScenarioDef(
        f"short-prompts-k{k}",
        f"prompts of 1, 2, K+1 and K+2 tokens arriving together (K={k}): each starts "
        "as a prefill from zero state",
        EngineSettings(num_speculative_tokens=k),
        build,
        ("new-short-prompt",),
    )


def _short_prompts_mixed(k: int, tiers=TIERS) -> ScenarioDef:
    def build(b):
        b.add(20, b.size(10, 40))
        b.add(27, b.size(10, 40))
        for i, n in enumerate(range(1, k + 3)):
            b.add(n, b.size(4, 16), arrival=2 + i)

    return ScenarioDef(
        f"short-prompts-mixed-k{k}",
        f"prompts of 1..K+2 tokens arriving one per step while two long requests decode (K={k})",
        EngineSettings(num_speculative_tokens=k),
        build,
        ("new-short-prompt", "mixed-batch"),
        tiers,
    )


def _chunk_tails(k: int) -> ScenarioDef:
    budget = 8

    def build(b):
        # Each of the first prompts arrives once the one before finished, so it gets the whole
        # budget and its last chunk is exactly t tokens, for every t in 1..K+1. The last two
        # arrive together and are chunked next to each other's decodes.
        arrival, new = 0, b.size(3, 12)
        for t in range(1, k + 2):
            b.add(budget + t, new, arrival=arrival)
            arrival += 2 + new + 1
        b.add(2 * budget + 1, new, arrival=arrival)
        b.add(3 * budget - 1, new, arrival=arrival)

    return ScenarioDef(
        f"chunk-tails-k{k}",
        f"a budget of {budget} tokens cuts prompts into chunks whose last piece is 1..K+1 tokens (K={k})",
        EngineSettings(num_speculative_tokens=k, max_num_batched_tokens=budget),
        build,
        ("chunk-tails",),
    )


def _churn(k: int) -> ScenarioDef:
    def build(b):
        for i in range(b.size(8, 40)):
            b.add(b.rng.randint(2, 12), b.rng.randint(1, b.size(4, 8)), arrival=i)

    return ScenarioDef(
        f"churn-k{k}", f"a request arrives every step and ragged max_tokens finish others, three seats, so "
        f"rows move between steps (K={k})", EngineSettings(num_speculative_tokens=k, max_num_seqs=3), build,
        ("batch-churn",))


def _preemption(k: int) -> ScenarioDef:
    def build(b):
        lengths = (10, 16, 7, 12, 5, 3) if not b.nightly else (20, 30, 9, 25, 14, 3, 17, 11)
        for n in lengths:
            b.add(n, b.size(8, 30))

    # 12 blocks is the smallest pool that still holds one request of max_model_len (40 + 2K tokens).
    return ScenarioDef(
        f"preemption-k{k}",
        f"a pool of 12 KV blocks of 4 tokens cannot hold the growing requests: the newest "
        f"are preempted and recomputed (K={k})",
        EngineSettings(num_speculative_tokens=k, block_size=4, num_kv_blocks=12, max_model_len=40),
        build,
        ("preemption",),
    )


def _recycled_slots(k: int) -> ScenarioDef:
    def build(b):
        for n in (30, 25, 40, 12):
            b.add(n, b.size(4, 20))
        for n in range(1, k + 3):
            b.add(n, b.size(4, 16), arrival=b.size(8, 26))

    return ScenarioDef(
        f"recycled-slots-k{k}",
        f"four requests fill every state slot and finish; short prompts then reuse the "
        f"slots, which still hold old state (K={k})",
        EngineSettings(num_speculative_tokens=k, max_num_seqs=4),
        build,
        ("recycled-slot", "new-short-prompt"),
    )


def _graph_padding(k: int, drafter: str, pattern: str, tiers=TIERS) -> ScenarioDef:
    def build(b):
        scale = b.size(1, 3)
        step = k + 1 if pattern == "all-accept" else 1  # tokens per verify step
        for n, stop in zip((3, 5, 7, 9, 11, 4, 6), (1, 1, 2, 2, 3, 3, 3)):
            b.add(n, 1 + step * stop * scale)

    return ScenarioDef(
        f"graph-padding-k{k}",
        f"7, then 5, then 3 concurrent decodes: batch sizes a CUDA graph must pad (K={k})",
        EngineSettings(num_speculative_tokens=k, drafter=drafter, pattern=pattern),
        build,
        ("decode-batches-3-5-7",),
        tiers,
    )


def _scripted(k: int, pattern: str, name: str, triggers: tuple[str, ...], tiers=TIERS) -> ScenarioDef:
    def build(b):
        lengths = (1, k + 1, k + 2, 17) if not b.nightly else (1, 2, k + 1, k + 2, 9, 17, 33)
        for n in lengths:
            b.add(n, b.size(8, 40))

    return ScenarioDef(
        f"scripted-{name}-k{k}",
        f"a scripted drafter proposes the true continuation with {pattern} correct tokens per step (K={k})",
        EngineSettings(num_speculative_tokens=k, drafter="scripted", pattern=pattern),
        build,
        triggers,
        tiers,
    )


def _zero_draft_steps(k: int, tiers=TIERS) -> ScenarioDef:
    def build(b):
        # Scripted counts ("gaps": K accepted drafts, a step with none, K-1 accepted, none, ...) make the
        # acceptance pattern the model's predictions cannot change. Two requests start together and run
        # alone in step with each other: a step of theirs has no drafts at all right after one that accepted
        # K. Two more start three steps later, out of step: from then on every step has rows verifying
        # drafts next to rows verifying none, first in one order and then in the other.
        for arrival, n in ((0, 2), (3, 2)):
            for _ in range(n):
                b.add(b.rng.randint(3, 12), b.size(20, 48) - 4 * arrival, arrival=arrival)

    return ScenarioDef(
        f"scripted-zero-draft-k{k}",
        f"scripted drafts accepted, then a step without drafts, on any model: steps where no row has drafts "
        f"and steps where rows with drafts run next to rows without (K={k})",
        EngineSettings(num_speculative_tokens=k, drafter="scripted", pattern="gaps"),
        build,
        ("spec-verify", "zero-draft-after-accept", "zero-draft-step", "spec-and-nonspec-rows",
         *(("partial-drafts",) if k > 1 else ())),
        tiers,
    )


def _mtp(k: int) -> ScenarioDef:
    def build(b):
        for n in (1, 3, 6, 13, 21):
            b.add(n, b.size(8, 48))

    return ScenarioDef(
        f"mtp-k{k}", f"MTP-head drafts verified by the target model (K={k})",
        EngineSettings(num_speculative_tokens=k), build, ("spec-verify",))


def _eagle(method: str, k: int, tiers=TIERS) -> ScenarioDef:
    def build(b):
        for n in (1, 3, 6, 13, 21):
            b.add(n, b.size(8, 48))
        b.add(b.size(20, 40), b.size(6, 24), arrival=3)  # a prompt chunked while the others verify

    name = "EAGLE-3" if method == "eagle3" else "EAGLE-1"
    return ScenarioDef(
        f"{method}-k{k}", f"{name}-head drafts (the suite's seeded head for the model) verified by the "
        f"target model (K={k})",
        EngineSettings(num_speculative_tokens=k, drafter=method, max_num_batched_tokens=32),
        build, ("spec-verify",), tiers)


def _eagle_cached(method: str, k: int, tiers=TIERS) -> ScenarioDef:
    bs = 4

    def build(b):
        system = b.prompt(4 * bs + 1)
        _add_sharing(b, system, 3, b.size(6, 20), arrival=0)
        for n, extra in ((2 * bs, 2), (3 * bs + 1, 1), (4 * bs + 1, 2)):
            _add_sharing(b, system[:n], extra, b.size(6, 20), arrival=8)

    name = "EAGLE-3" if method == "eagle3" else "EAGLE-1"
    return ScenarioDef(
        f"pc-{method}-k{k}",
        f"prefix caching (align) with an {name} head: a hit drops the last block of its matched run (vLLM's "
        f"rule for drafters keeping KV), block size {bs} (K={k})",
        EngineSettings(num_speculative_tokens=k, drafter=method, block_size=bs, max_num_batched_tokens=12,
                       enable_prefix_caching=True, mamba_cache_mode="align"), build, ("prefix-hit",), tiers,
        ("prefix-caching",))


def _stop_tokens(k: int) -> ScenarioDef:
    def build(b):
        # Each request stops on its own random half of the vocabulary: whatever a model generates, some
        # request's first stop lands inside a verified window (with all-accept drafts, 3 of every 4
        # positions after the first token), not only on a model whose outputs meet one fixed stop set.
        for i, n in enumerate((2, 5, 8, 11, 14, 17, 3, 6, 9, 12)[: b.size(8, 10)]):
            stops = tuple(sorted(b.rng.sample(range(b.vocab_size), max(1, b.vocab_size // 2))))
            b.add(n, b.size(10, 48), ignore_eos=False, stop_token_ids=stops)

    return ScenarioDef(
        f"stop-tokens-k{k}",
        f"stop tokens end requests at data-dependent points, also in the middle of an "
        f"accepted draft window (K={k})",
        EngineSettings(num_speculative_tokens=k, drafter="scripted", pattern="all-accept"),
        build,
        ("stop-mid-window",),
        model_decides=(("stop-mid-window", ("a text of one or two ids over and over can stop every request "
                        "at its first token, or never")),),
    )


NGRAM_TEXT = ("the model's text decides where the lookup finds drafts and whether they are kept "
              "(params-ngram-k3 forces both on any model)")


def _ngram(k: int, lookup: tuple[int, int]) -> ScenarioDef:
    def build(b):
        # Prompts repeating a phrase of 1..3 ids (the lookup hits them, also near their end: fewer
        # than K drafts) next to random ones (it misses until the output repeats itself), arriving
        # two per step so rows move and FULL steps pad.
        for i in range(b.size(8, 16)):
            b.add(b.rng.randint(4, 24), b.size(40, 64), arrival=i // 2, repeat=i % 4)

    # Whether n-gram drafts of the model's text are accepted is the model's to say: at K=1 a checkpoint may
    # accept none, so only K=3 asks for the transitions, as the model's (params-ngram-k3 and
    # scripted-zero-draft-k* reach them on any model).
    triggers = ("zero-draft-after-accept", "partial-drafts") if k > 1 else ()
    lo, hi = lookup
    return ScenarioDef(
        f"ngram-k{k}",
        f"n-gram prompt lookup ({lo}..{hi}-grams) proposes 0..K drafts per step: a request that "
        f"accepted drafts may verify none in its next step (K={k})",
        EngineSettings(num_speculative_tokens=k, drafter="ngram", prompt_lookup_min=lo, prompt_lookup_max=hi),
        build,
        ("spec-verify", *triggers),
        model_decides=tuple((t, NGRAM_TEXT) for t in triggers),
    )


def _ngram_max_len(k: int, tiers=NIGHTLY) -> ScenarioDef:
    def build(b):
        # Repeated phrases keep the lookup proposing drafts up to the last position the model allows.
        for i in range(b.size(4, 8)):
            b.add(b.rng.randint(4, 20), 64, arrival=i // 2, repeat=1 + i % 3)

    return ScenarioDef(
        f"ngram-max-len-k{k}",
        f"n-gram prompt lookup runs requests into max_model_len 40, drafting to the very end (K={k})",
        EngineSettings(num_speculative_tokens=k, drafter="ngram", prompt_lookup_min=1, prompt_lookup_max=3,
                       max_model_len=40),
        build,
        ("spec-verify", "ngram-max-model-len", "length-stop-at-max-len"),
        tiers,
    )


def _spec_max_len(k: int, tiers=NIGHTLY) -> ScenarioDef:
    def build(b):
        # Prompts of every length near the limit, each with room for more tokens than the model allows.
        for n in (1, 5, 20, 33, 35, 36, 37, 38, 39):
            b.add(n, 48, arrival=n % 3)

    return ScenarioDef(
        f"spec-max-len-k{k}",
        f"MTP speculation up to max_model_len 40: length stops where the last verify step could keep more "
        f"than the model allows (K={k})",
        EngineSettings(num_speculative_tokens=k, max_model_len=40),
        build,
        ("spec-verify", "length-stop-at-max-len"),
        tiers,
    )


def _chunk_ahead(k: int, tiers=NIGHTLY) -> ScenarioDef:
    def build(b):
        # Mode "all" ends every prompt chunk at the next block boundary, so a long prompt's chunk leaves
        # budget for the short prompts arriving one per step: they sample in the same step, after the chunk.
        # Without the cache's clipping a budget cut chunk takes the rest of the budget and runs last.
        b.add(b.size(30, 60), 4)
        for i in range(b.size(6, 12)):
            b.add(2 + i % 4, 3, arrival=1 + i)

    return ScenarioDef(
        f"chunk-ahead-k{k}",
        f"prompt chunks that do not sample placed ahead of short prompts that do, MTP drafts chained past "
        f"them (K={k}; mode 'all' clips the chunks, the prefix cache is not what is tested)",
        _cache_settings(k, "all", max_num_batched_tokens=16),
        build,
        ("chunk-ahead-of-sampling",),
        tiers,
    )


def _soak(k: int) -> ScenarioDef:
    def build(b):
        for i in range(60):
            b.add(b.rng.randint(1, 40), b.rng.randint(1, 24), arrival=b.rng.randint(0, 80))

    return ScenarioDef(
        f"soak-k{k}",
        f"60 requests with random lengths and arrivals through a small, preempting pool (K={k})",
        EngineSettings(
            num_speculative_tokens=k,
            drafter="scripted",
            max_num_seqs=6,
            max_num_batched_tokens=32,
            block_size=4,
            num_kv_blocks=40,
            max_model_len=120,
        ),
        build,
        ("preemption", "batch-churn"),
        NIGHTLY,
    )


def _long_prompts(k: int) -> ScenarioDef:
    def build(b):
        for n in (150, 201, 96, 257):
            b.add(n, 32)

    return ScenarioDef(
        f"long-prompts-k{k}", f"long prompts prefilled in many 64-token chunks next to decodes (K={k})",
        EngineSettings(num_speculative_tokens=k, max_num_batched_tokens=64), build, (), NIGHTLY)


# ---- prefix caching ----------------------------------------------------------------------------------
# The engine under test runs with the cache, the oracle without: "tokens", "acceptance" and
# "logits-digests" hold every hit to the uncached output, "cached-tokens" every count to its ceiling,
# "restored-state" every hit's first row and logits, "cache-lossless" the reference engine's own cache.
# A later wave arrives at ``LATER`` (the harness skips idle steps), once the earlier requests finished,
# so its counts are pinned exactly; the pool is roomy unless the scenario is about pressure.
LATER = 200
ROOMY = 256  # KV blocks: more than every request of a non-pressure scenario can allocate


def _cache_settings(k: int, mode: str, drafter: str = "mtp", **kw) -> EngineSettings:
    kw = {"block_size": 4, "num_kv_blocks": ROOMY, "max_model_len": 160, **kw}
    return EngineSettings(
        num_speculative_tokens=k,
        drafter=drafter,
        pattern="hash",
        enable_prefix_caching=True,
        mamba_cache_mode=mode,
        **kw,
    )


def _cache_def(name: str, k: int, mode: str, description: str, settings: EngineSettings, build,
               triggers: tuple[str, ...], tiers=TIERS, model_decides=()) -> ScenarioDef:
    text = f"{description} (K={k}, mode {mode}; cached engine under test vs the uncached oracle)"
    return ScenarioDef(f"prefix-{name}-k{k}", text, settings, build, ("prefix-hit", *triggers), tiers,
                       ("prefix-caching",), model_decides=model_decides)


def _system_prompt(k: int, mode: str, tiers=TIERS) -> ScenarioDef:
    # A shared prefix one token past a block boundary: the boundary is the last of the first request's
    # prompt (where "align" keeps a state), and a block key with an MTP drafter covers the token after it.
    def build(b):
        system, other = b.prompt(3 * 4 + 1), b.prompt(2 * 4 + 1)
        b.add_ids(system + b.prompt(2), b.size(4, 16))  # warms the cache
        for n in range(b.size(4, 8)):  # arrive together once it finished: they hit it side by side
            b.add_ids(system + b.prompt(1 + n), b.size(5, 20), arrival=LATER)
        b.add_ids(other + b.prompt(2), b.size(6, 20), arrival=LATER)  # two cold ones share a prefix...
        b.add_ids(other + b.prompt(3), b.size(6, 20), arrival=LATER)
        b.add_ids(other + b.prompt(1), b.size(4, 12), arrival=LATER + 3)  # ...that a third finds half-way

    return _cache_def(
        "system-prompt",
        k,
        mode,
        "a system prompt shared by concurrent requests, cached by a "
        "first one; another prefix first seen by two requests at once",
        _cache_settings(k, mode),
        build,
        ("concurrent-hits",),
        tiers,
    )


def _multi_turn(k: int, mode: str, tiers=TIERS) -> ScenarioDef:
    def build(b):
        for chat in range(b.size(2, 3)):
            turn = b.add(6 + 3 * chat, b.size(6, 14), arrival=chat)
            for _ in range(b.size(2, 4)):  # each turn: the previous prompt and reply, then a few new tokens
                turn = b.extend(turn, b.rng.randint(0, 3), b.size(5, 12))

    return _cache_def(
        "multi-turn",
        k,
        mode,
        "multi-turn chats: each prompt is the previous prompt and reply "
        "plus a few tokens, so hits reach blocks the decode steps wrote",
        _cache_settings(k, mode),
        build,
        ("hit-on-output",),
        tiers,
    )


def _block_edges(k: int, mode: str, drafter: str = "mtp", tiers=TIERS) -> ScenarioDef:
    bs = 4

    def build(b):
        base = b.prompt(6 * bs + 2)
        for n in (2, 3, 4, 5):  # sources one token past the grid: in both modes a state at each boundary
            b.add_ids(base[: n * bs + 1], b.size(3, 10))
        for n in (3, 5):
            for d in (
                -1,
                0,
                1,
            ):  # prefixes of block boundary -1, 0 and +1 tokens, and the same plus new tokens
                b.add_ids(base[: n * bs + d], b.size(4, 12), arrival=LATER)
                b.add_ids(base[: n * bs + d] + b.prompt(2), b.size(4, 12), arrival=LATER)

    return _cache_def(
        "block-edges",
        k,
        mode,
        f"prompt lengths at block boundaries -1/0/+1 ({bs}-token blocks) over cached prefixes",
        _cache_settings(k, mode, drafter),
        build,
        ("hit-block-edges",),
        tiers,
    )


def _short_tail(k: int, mode: str, tiers=TIERS) -> ScenarioDef:
    bs = 4

    def build(b):
        base = b.prompt(5 * bs + 3)
        b.add_ids(base[: 4 * bs + 1], b.size(4, 12))  # its last prompt boundary, 4 blocks, holds a state
        for tail in range(1, k + 2):  # 1..K+1 prompt tokens left after the hit: fewer than 1+K but the last
            b.add_ids(base[: 4 * bs + tail], b.size(5, 16), arrival=LATER)

    return _cache_def(
        "short-tail",
        k,
        mode,
        "hits that leave 1..K+1 prompt tokens to compute: a prefill from the restored state, however short",
        _cache_settings(k, mode),
        build,
        ("hit-short-tail",),
        tiers,
    )


def _eviction(k: int, mode: str, tiers=TIERS) -> ScenarioDef:
    def build(b):
        systems = [b.prompt(3 * 4 + 1) for _ in range(4)]
        for i, system in enumerate(systems):
            b.add_ids(system + b.prompt(2), b.size(4, 6), arrival=i)
        for i, system in enumerate(reversed(systems)):  # the newest are still cached, the oldest evicted
            b.add_ids(system + b.prompt(3), b.size(4, 6), arrival=LATER + i)

    return _cache_def(
        "eviction",
        k,
        mode,
        "more distinct prefixes than a pool of 16 KV blocks keeps: the least recently used are evicted",
        _cache_settings(k, mode, num_kv_blocks=16, max_model_len=40, max_num_seqs=2),
        build,
        ("eviction",),
        tiers,
    )


def _eviction_order(k: int, mode: str, tiers=TIERS) -> ScenarioDef:
    bs = 4

    def build(b):
        # One request at a time. Three old prompts fill the pool with cached blocks, a fourth is the one a
        # later prompt continues, and a long filler then takes more blocks than the pool has never used:
        # the pool must evict the old prompts' blocks (released first), never the fourth's, so the last
        # request's floor ("cache-floor") is the fourth's whole prompt.
        old = [b.prompt(3 * bs + 1) for _ in range(3)]
        for prompt in old:
            b.add_ids(prompt, 3)
        kept = b.prompt(3 * bs + 1)
        b.add_ids(kept, 3)
        b.add(5 * bs + 1, 3)
        b.add_ids(kept + b.prompt(2), b.size(4, 8), arrival=LATER)
        b.add_ids(old[0] + b.prompt(2), b.size(4, 8), arrival=LATER)  # the oldest was evicted: it hits less

    return _cache_def(
        "eviction-order",
        k,
        mode,
        "a pool of 16 KV blocks under pressure, one request at a time: the least recently released blocks "
        "go first, so the last prompt still finds the newest source whole",
        _cache_settings(k, mode, num_kv_blocks=16, max_model_len=40, max_num_seqs=1),
        build,
        ("eviction", "floor-under-pressure"),
        tiers,
    )


def _shared_preemption(k: int, mode: str, tiers=TIERS) -> ScenarioDef:
    def build(b):
        system = b.prompt(4 * 4)
        b.add_ids(system + b.prompt(1), b.size(4, 8))
        for n in (2, 3, 5, 6):  # they share the cached prefix and outgrow the pool together
            b.add_ids(system + b.prompt(n), b.size(16, 30), arrival=LATER)

    return _cache_def(
        "shared-preemption",
        k,
        mode,
        "requests sharing a cached prefix outgrow a pool of 17 KV blocks: "
        "one whose blocks the others share is preempted and resumed",
        _cache_settings(k, mode, "scripted", num_kv_blocks=17, max_model_len=60, max_num_seqs=4),
        build,
        ("shared-preemption",),
        tiers,
    )


def _offset_blocks(k: int, mode: str, tiers=TIERS) -> ScenarioDef:
    bs = 4

    def build(b):
        # Identical token blocks at different offsets: equal blocks, but not equal prefixes, so a block's key
        # must cover everything before it. Only the last request shares a real prefix with the first.
        a, c, d = b.prompt(bs), b.prompt(bs), b.prompt(bs)
        first = a + c + d + b.prompt(1)
        b.add_ids(first, b.size(4, 12))
        b.add_ids(c + d + a + b.prompt(2), b.size(4, 12), arrival=LATER)  # each block one place earlier
        b.add_ids(a + a + c + b.prompt(1), b.size(4, 12), arrival=LATER)  # a block repeated in one prompt
        b.add_ids(first + b.prompt(2), b.size(4, 12), arrival=LATER + 1)

    return _cache_def(
        "offset-blocks",
        k,
        mode,
        "prompts holding the same token blocks at different offsets: no hit unless the whole prefix matches",
        _cache_settings(k, mode),
        build,
        ("blocks-at-offsets",),
        tiers,
    )


def _small_blocks(k: int, mode: str, drafter: str = "mtp", tiers=NIGHTLY) -> ScenarioDef:
    bs = 2

    def build(b):
        # Blocks of 2 tokens with K=3: one verify step keeps up to 4 tokens and so passes up to two block
        # boundaries, the first inside its kept tokens; next turns hit the checkpoints it left there.
        for chat in range(b.size(2, 3)):
            turn = b.add(5 + 2 * chat, b.size(8, 16), arrival=chat)
            for _ in range(b.size(2, 3)):
                turn = b.extend(turn, b.rng.randint(0, 2), b.size(8, 14))

    return _cache_def(
        f"small-blocks-{mode}",
        k,
        mode,
        f"blocks of {bs} tokens, no longer than K: a verify step passes several block boundaries, and hits "
        "land on boundaries inside a step's kept tokens",
        _cache_settings(k, mode, drafter, block_size=bs, num_kv_blocks=4 * ROOMY),
        build,
        ("hit-on-output", "boundaries-in-one-step", "checkpoint-inside-step"),
        tiers,
        # a step keeps three tokens or more where two drafts are accepted: scripted, on any model
        tuple((t, "the MTP head's drafts decide how many tokens a verify step keeps")
              for t in ("boundaries-in-one-step", "checkpoint-inside-step")) if drafter == "mtp" else (),
    )


def _off_grid_chunk(k: int, tiers=NIGHTLY) -> ScenarioDef:
    bs = 4

    def build(b):
        # Two prompts arrive together under a budget of 6: the second's first chunk is cut 2 tokens into a
        # block, so its next chunk starts off the grid (mode all still ends it on the grid); later prompts
        # continue both and hit the blocks those chunks left.
        first, second = b.prompt(3 * bs + 1), b.prompt(3 * bs + 1)
        b.add_ids(first, b.size(4, 10))
        b.add_ids(second, b.size(4, 10))
        b.add_ids(second + b.prompt(2), b.size(4, 10), arrival=LATER)
        b.add_ids(first + b.prompt(1), b.size(4, 10), arrival=LATER)

    return _cache_def(
        "off-grid-chunk",
        k,
        "all",
        "a budget cut starts an 'all' prompt chunk off the block grid before a later request hits its blocks",
        _cache_settings(k, "all", max_num_batched_tokens=6),
        build,
        ("off-grid-chunk-before-hit",),
        tiers,
    )


def _prefix_caching() -> list[ScenarioDef]:
    return [
        _system_prompt(0, "all"),
        _system_prompt(3, "align"),
        _multi_turn(1, "align"),
        _multi_turn(3, "all", NIGHTLY),
        _block_edges(0, "all"),
        _block_edges(1, "align"),
        _block_edges(3, "all", "scripted"),
        _short_tail(3, "all"),
        _short_tail(1, "align", NIGHTLY),
        _eviction(0, "all"),
        _eviction(3, "align", NIGHTLY),
        _eviction_order(0, "all"),
        _eviction_order(3, "align", NIGHTLY),
        _offset_blocks(0, "all"),
        _offset_blocks(3, "align", NIGHTLY),
        _small_blocks(3, "align"),
        _small_blocks(3, "all", "scripted"),
        _off_grid_chunk(1),
        _shared_preemption(3, "align"),
    ]


def _add_sharing(b, prefix: tuple[int, ...], extra: int, max_tokens: int, arrival: int) -> None:
    """A request whose prompt is ``prefix`` followed by ``extra`` fresh tokens."""
    prompt = prefix + (b.prompt(extra) if extra else ())
    b.requests.append(RequestSpec(f"r{len(b.requests):02d}", prompt, max_tokens, arrival))


def _shared_prompt(k: int, mode: str) -> ScenarioDef:
    bs = 4

    def build(b):
        system = b.prompt(3 * bs + 2)
        # A long prompt prefilled in chunks while a short one already decodes (their rows swap order),
        # then prompts that share its first 2, 3 or all of its blocks (and one token either side).
        _add_sharing(b, system, 2 * bs, b.size(6, 24), arrival=0)
        b.add(3, b.size(10, 30), arrival=0)
        for n, extra in ((2 * bs + 1, 0), (2 * bs + 2, 3), (3 * bs - 1, 0), (3 * bs, 2), (3 * bs + 1, 1)):
            _add_sharing(b, system[:n], extra, b.size(6, 24), arrival=8)

    return ScenarioDef(
        f"pc-shared-prompt-k{k}-{mode}",
        f"prefix caching ({mode}): prompts sharing a long prompt's first blocks arrive once its chunks are "
        f"published, block size {bs} (K={k})",
        EngineSettings(num_speculative_tokens=k, block_size=bs, max_num_batched_tokens=12,
                       enable_prefix_caching=True, mamba_cache_mode=mode), build, ("mixed-batch",))


def _cached_preemption(k: int) -> ScenarioDef:
    def build(b):
        system = b.prompt(9)
        for extra in (1, 4, 6):
            _add_sharing(b, system, extra, b.size(16, 30), arrival=0)

    # The pool holds one request of max_model_len, so the sharers preempt each other; a resumed request
    # looks up its prompt and outputs, and hits the blocks its own verify steps published.
    return ScenarioDef(
        f"pc-preemption-k{k}",
        f"prefix caching (all): requests sharing a prompt preempt each other in a pool of 14 KV blocks of 4 "
        f"tokens and resume on hits reaching into their outputs (scripted drafter, K={k})",
        EngineSettings(num_speculative_tokens=k, drafter="scripted", block_size=4, num_kv_blocks=14,
                       max_model_len=48, enable_prefix_caching=True, mamba_cache_mode="all"),
        build, ("preemption",))


def scenario_defs() -> tuple[ScenarioDef, ...]:
    """Every scenario definition, sorted by id (a fresh tuple: callers cannot change the corpus).

    No scenario uses the scripted drafter's "cycle" pattern for "every-accept-count": the pattern
    proposes (committed outputs mod K+1) correct drafts, and since the first verify step starts at one
    committed output and each step commits accepted + 1 tokens, the count never returns to 0 (with
    K=1 every step accepts all; with K=2 it alternates 1, 0 but never reaches 2). The ragged ("hash")
    pattern reaches every count.
    """
    defs = [
        *(_short_prompts(k) for k in (0, 1, 3)),
        _short_prompts_mixed(1, NIGHTLY),
        _short_prompts_mixed(3),
        *(_chunk_tails(k) for k in (0, 1, 3)),
        *(_churn(k) for k in (1, 3)),
        *(_preemption(k) for k in (0, 3)),
        *(_recycled_slots(k) for k in (0, 3)),
        _graph_padding(0, "mtp", "hash"),
        _graph_padding(1, "scripted", "all-reject"),
        _graph_padding(3, "scripted", "all-accept", NIGHTLY),
        _scripted(3, "hash", "ragged", ("every-accept-count",)),
        _scripted(3, "all-accept", "all-accept", ("accept-all",), NIGHTLY),
        _scripted(3, "all-reject", "all-reject", ("reject-all",), NIGHTLY),
        _scripted(1, "hash", "ragged", ("every-accept-count",), NIGHTLY),
        _zero_draft_steps(3),
        _zero_draft_steps(1, NIGHTLY),
        *(_mtp(k) for k in (1, 3)),
        _eagle("eagle3", 3),
        _eagle("eagle", 3, NIGHTLY),
        *(_eagle(m, 1, NIGHTLY) for m in ("eagle", "eagle3")),
        _eagle_cached("eagle3", 3),
        _eagle_cached("eagle", 1, NIGHTLY),
        _ngram(1, (2, 4)),
        _ngram(3, (1, 3)),
        _stop_tokens(3),
        _ngram_max_len(3),
        _spec_max_len(3),
        _chunk_ahead(3),
        *(_soak(k) for k in (0, 3)),
        _long_prompts(3),
        *_prefix_caching(),
        *(_shared_prompt(k, mode) for k in (0, 3) for mode in ("all", "align")),
        _cached_preemption(3),
        *draft_model_defs(),  # draft models (conformance/workloads/draft_model_corpus.py)
        *param_defs(),  # requests that carry state (conformance/workloads/param_corpus.py)
        *sampling_defs(),  # seeded sampling and rejection sampling (conformance/workloads/sampling_corpus.py)
        *structured_defs(),  # structured outputs (conformance/workloads/structured_corpus.py)
        *regression_defs(),  # shrunk generated workloads that once failed (conformance/workloads/regressions)
    ]
    ids = [d.id for d in defs]
    if len(set(ids)) != len(ids):
        raise AssertionError("duplicate scenario ids in the corpus")
    return tuple(sorted(defs, key=lambda d: d.id))
