"""Draft-model scenarios (``drafter="draft_model"``): the run's own model cut to some of its layers drafts for
it (``EngineSettings.draft_model = "cut:<layers>"``), so its drafts are often right and often wrong, and on a
hybrid model the draft model keeps recurrent state of its own under the s_0..s_K contract."""

from __future__ import annotations

from conformance.workloads.scenario import EngineSettings, ScenarioDef

NIGHTLY = ("nightly",)
BLOCK = 4


def _draft_model(k: int, cut: str, name: str, text: str, triggers: tuple[str, ...],
                 tiers=("default", "nightly"), **settings) -> ScenarioDef:
    def build(b):
        # Short prompts (1, K+1, K+2 tokens) next to two sharing a prompt's first blocks, the second
        # arriving once the first published them (a prefix hit restores the draft model's state too).
        shared = b.prompt(3 * BLOCK + 1)
        b.add_ids(shared, b.size(12, 40))
        for n in sorted({1, k + 1, k + 2}):
            b.add(n, b.size(8, 24), arrival=1)
        b.add_ids(shared[: 2 * BLOCK + 2] + b.prompt(3), b.size(12, 40), arrival=b.size(6, 10))
        for i in range(b.size(0, 4)):
            b.add(b.rng.randint(2, 20), b.size(6, 30), arrival=2 + i)

    return ScenarioDef(
        f"draft-model-{name}k{k}",
        f"a draft model ({cut}: the run's model cut to those layers, its own KV cache and recurrent state) "
        f"drafts {text} (K={k})",
        EngineSettings(num_speculative_tokens=k, drafter="draft_model", draft_model=cut, block_size=BLOCK,
                       max_num_seqs=4, **settings),
        build,
        ("spec-verify", *triggers),
        tiers,
        model_decides=(("reject-all", ("whether the cut model's first draft is ever wrong is the "
                        "checkpoint's")),) if "reject-all" in triggers else (),
    )


def draft_model_defs() -> list[ScenarioDef]:
    return [
        _draft_model(3, "cut:0,3", "", "with prefix caching on ('all'; a budget of 8 chunks the prompts, "
                     "so 'align' hits too): drafts are rejected and accepted by turns",
                     ("reject-all", "prefix-hit"), enable_prefix_caching=True, mamba_cache_mode="all",
                     max_num_batched_tokens=8),
        _draft_model(1, "cut:2", "", "with prefix caching on ('align', prompts chunked by a budget of 6)",
                     ("reject-all", "prefix-hit"), NIGHTLY, enable_prefix_caching=True,
                     max_num_batched_tokens=6),
        _draft_model(3, "cut:all", "whole-", "as the target does: every draft is accepted", ("accept-all",),
                     NIGHTLY),
        _draft_model(3, "cut:1", "preemption-", "in a pool of 12 KV blocks of 4 tokens: requests are "
                     "preempted and recomputed", ("preemption",), NIGHTLY, num_kv_blocks=12,
                     max_model_len=40),
    ]
