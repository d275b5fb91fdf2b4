"""Sampled workloads (issue 37): seeded, unseeded and greedy requests side by side.

A sampled request's tokens are a function of its seed and positions only, so the exact checks
(``tokens``, ``acceptance``, ``drafts``, ``logits-digests``) apply to these scenarios unchanged: the
engine under test must draw what the reference draws, whatever rows, steps, preemptions and cache hits
its batches hold. An unseeded request reports the seed it drew at admission, and both engines must
report the same one (``request-outputs``). Speculation is lossless in distribution only here: the
nightly ``spec-distribution`` check holds that; ``spec-lossless`` holds the greedy requests.

Preemption runs with K=0: under standard rejection sampling the token at a position depends on whether a
draft was verified there (the acceptance uniform and the residual draw, or a fresh draw), and a preempted
request resumes with a prefill that verifies none; the two engines preempt at different points, so a
preempted sampled request is exact across them only without speculation.
"""

from __future__ import annotations

from conformance.workloads.scenario import TIERS, EngineSettings, ScenarioDef

NIGHTLY = ("nightly",)
# each sampling setting a request may carry: every filter alone and together, temperatures above and below 1
SETTINGS = (
    {"temperature": 0.8, "seed": 11},
    {"temperature": 1.0},  # unseeded: the seed drawn at admission
    {},  # greedy
    {"temperature": 1.3, "top_k": 6, "seed": 12},
    {"temperature": 0.7, "top_p": 0.8, "seed": 13},
    {"temperature": 1.0, "min_p": 0.1},  # unseeded
    {"temperature": 1.5, "top_k": 20, "top_p": 0.9, "min_p": 0.02, "seed": 14},
    {"temperature": 0.6, "seed": 11, "repetition_penalty": 1.2},  # the same seed as the first
    # nearly greedy: the scripted drafter's greedy continuation is kept whole, on any model (the penalty
    # makes its output differ from the bare request's)
    {"temperature": 0.05, "seed": 15, "repetition_penalty": 2.0, "frequency_penalty": 2.0},
)


# Why "sampled-draft-rejected" is the checkpoint's: a draft is kept with its probability under the model.
REJECTED = "a model whose distribution is peaked at the drafted ids keeps them"


def _mixed(b) -> None:
    """Three seats, requests finishing at different lengths and arriving later, so rows move and slots
    are reused; each sampling setting once, then a second wave on reused slots (two of them by default,
    the greedy one first, all of them nightly)."""
    n = b.size(8, 36)
    again = (SETTINGS[2:] + SETTINGS[:2])[: b.size(2, len(SETTINGS))]
    for i, params in enumerate(SETTINGS + again):
        b.add(b.rng.randint(2, 14), n - (i % 4) * 2, arrival=i // 2, params=params)


def _sampling_mixed(k: int, drafter: str = "mtp", tiers=TIERS) -> ScenarioDef:
    triggers = ("seeded-beside-unseeded", "params-rows-reordered", "slot-reused-unrestricted")
    if k:  # the scripted drafter's whole greedy windows are kept on any model, the others' on some
        triggers += ("sampled-draft-rejected",)
    if k and drafter == "scripted":
        triggers += ("sampled-drafts-all-kept",)
    lookup = {"prompt_lookup_min": 2, "prompt_lookup_max": 3} if drafter == "ngram" and k else {}
    return ScenarioDef(
        f"sampling-mixed-{drafter}-k{k}" if k else "sampling-mixed-k0",
        f"seeded, unseeded and greedy requests in one batch of three seats, with temperature, top-k, "
        f"top-p and min-p alone and together, rows moving and seats reused ({drafter} drafter, K={k})",
        EngineSettings(num_speculative_tokens=k, drafter=drafter if k else "mtp", max_num_seqs=3,
                       pattern="all-accept" if drafter == "scripted" else "hash", **lookup),
        _mixed,
        triggers,
        tiers,
        model_decides=(("sampled-draft-rejected", REJECTED),) if k else (),
    )


def _preempted(b) -> None:
    for i, n in enumerate((10, 16, 7, 12, 5, 3)):
        b.add(n, b.size(8, 30), params=SETTINGS[i % len(SETTINGS)])


def _sampling_preemption(k: int, tiers=TIERS) -> ScenarioDef:
    return ScenarioDef(
        f"sampling-preemption-k{k}",
        f"sampled requests outgrow a pool of 12 KV blocks of 4 tokens: preempted ones recompute and must "
        f"draw again what they drew (K={k}: a position's noise does not change with a preemption, but under "
        f"speculation whether a draft was verified there does, and the engines preempt at other points)",
        EngineSettings(num_speculative_tokens=k, block_size=4, num_kv_blocks=12, max_model_len=40),
        _preempted,
        ("params-preemption",),
        tiers,
    )


def _cached(b) -> None:
    system = b.prompt(3 * 4 + 1)
    b.add_ids(system + b.prompt(2), b.size(4, 12), params=SETTINGS[0])  # warms the cache
    for i in range(b.size(3, 8)):
        b.add_ids(system + b.prompt(1 + i), b.size(5, 20), arrival=8, params=SETTINGS[i % len(SETTINGS)])


def _sampling_prefix(k: int, mode: str, tiers=TIERS) -> ScenarioDef:
    return ScenarioDef(
        f"sampling-prefix-{mode}-k{k}",
        f"sampled requests sharing a cached system prompt: restored from the cache, they draw what the "
        f"uncached oracle draws (K={k}, mode {mode}; cached engine under test vs the uncached oracle)",
        EngineSettings(num_speculative_tokens=k, drafter="mtp", pattern="hash", enable_prefix_caching=True,
                       mamba_cache_mode=mode, block_size=4, max_model_len=160),
        _cached,
        ("prefix-hit", "params-prefix-hit"),
        tiers,
        ("prefix-caching",),
    )


# The statistical scenarios (nightly): groups of requests that differ in their seed only
# (conformance/checks/statistics.py); the seeds are the fixed set 0..N-1 of each group.
GROUP = 2000
FREQUENCY_GROUPS = (
    {"temperature": 1.0, "top_k": 20},
    {"temperature": 0.7, "top_k": 12, "top_p": 0.8},
    {"temperature": 1.5, "top_k": 20, "min_p": 0.05, "top_p": 0.95},
)
SPEC_GROUPS = ({"temperature": 1.0}, {"temperature": 1.3, "top_k": 8, "top_p": 0.9})


def _groups(b, groups: tuple, max_tokens: int, extra: dict) -> None:
    prompt = b.prompt(3)
    for params in groups:
        for seed in range(GROUP):
            b.add_ids(prompt, max_tokens, params={**params, **extra, "seed": seed})


def _sampling_frequencies() -> ScenarioDef:
    return ScenarioDef(
        "sampling-frequencies-k0",
        f"{len(FREQUENCY_GROUPS)} groups of {GROUP} requests (one prompt, seeds 0..{GROUP - 1}, top-k, top-p "
        f"and min-p settings) sampling one token each: their frequencies against the reference's logprobs",
        EngineSettings(max_num_seqs=64, max_num_batched_tokens=512),
        lambda b: _groups(b, FREQUENCY_GROUPS, 1, {"logprobs": 20}),
        (),
        NIGHTLY,
    )


def _spec_distribution(k: int) -> ScenarioDef:
    return ScenarioDef(
        f"sampling-spec-distribution-k{k}",
        f"{len(SPEC_GROUPS)} groups of {GROUP} requests (one prompt, seeds 0..{GROUP - 1}) sampling four "
        f"tokens with K={k} MTP drafts: distributed as the plain (K=0) run's",
        EngineSettings(num_speculative_tokens=k, drafter="mtp", max_num_seqs=64, max_num_batched_tokens=512),
        lambda b: _groups(b, SPEC_GROUPS, 1 + k, {}),
        ("sampled-draft-rejected",),
        NIGHTLY,
        model_decides=(("sampled-draft-rejected", REJECTED),),
    )


def sampling_defs() -> list[ScenarioDef]:
    return [
        _sampling_mixed(3),
        _sampling_mixed(0, tiers=NIGHTLY),
        _sampling_mixed(3, "ngram", NIGHTLY),
        _sampling_mixed(3, "scripted", NIGHTLY),
        _sampling_preemption(0),
        _sampling_prefix(3, "align"),
        _sampling_prefix(3, "all", NIGHTLY),
        _sampling_frequencies(),
        _spec_distribution(3),
    ]
