"""What an engine adapter may support (``EngineAdapter.supports``), and what a scenario or a gate may
need of it. Plain names, importable without torch or refengine: the pytest plugin's options list them
in every pytest run of an environment holding the package. conformance.engines re-exports them."""

from __future__ import annotations

# Features an adapter may support; the checks that need one are "n/a" without it.
FEATURES = (
    "step_records",  # calls the observer with StepRecords every step
    "batch_invariant",  # a request's logits do not depend on its batch (logits digests are comparable)
    "pools",  # can tell whether its KV-block and state-slot pools are empty
    "mtp",  # drafts with the model's MTP head
    "scripted_drafter",  # takes refengine's ScriptedDrafter
    "ngram_drafter",  # drafts by n-gram prompt lookup (vLLM's "ngram", prompt_lookup_min/max): 0..K per step
    "draft_model",  # drafts with a separate checkpoint (vLLM's "draft_model"), EngineSettings.draft_model
    "eagle_drafter",  # drafts with an EAGLE-1 / EAGLE-3 head (vLLM's "eagle" / "eagle3", a head folder)
    "prefix_caching",  # runs with EngineSettings.enable_prefix_caching / mamba_cache_mode
    # (reports num_cached_tokens)
    "bitwise",  # runs the reference's kernels: its tokens, drafts and logits are bitwise the reference
    # engine's in the same dtype on the same device (--verdict auto judges it exactly there, else rescored)
)
# What a scenario may need of the engine under test (conformance.harness.needed_features): drafters,
# prefix caching, and "abort" (the instance's optional ``abort(request_id)``, found on the instance).
SCENARIO_FEATURES = ("mtp", "scripted_drafter", "ngram_drafter", "draft_model", "eagle_drafter",
                     "prefix_caching", "abort")
# What a gate may require (--require-feature): every adapter feature, and "abort".
REQUIRABLE_FEATURES = (*FEATURES, "abort")
# The feature a scenario's drafter needs (EngineSettings.drafter -> FEATURES entry).
DRAFTER_FEATURES = {"mtp": "mtp", "scripted": "scripted_drafter", "ngram": "ngram_drafter",
                    "draft_model": "draft_model", "eagle": "eagle_drafter", "eagle3": "eagle_drafter"}


def missing_features(adapter, required) -> list[str]:
    """The ``required`` features the adapter says it lacks ("abort" is known per instance only)."""
    return [f for f in required if f != "abort" and not adapter.supports(f)]
