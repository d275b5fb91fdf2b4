"""This project's own engines as engines under test: ``LLM(engine="reference")`` and ``LLM(engine="async",
graph_mode=...)``, seen through the ``conformance.api`` protocol."""

from __future__ import annotations

import dataclasses

from conformance.api import FEATURES, EngineInstance, RequestParams, RunSpec, UnknownEngine
from refengine import SamplingParams
from refengine.config import GRAPH_MODES

# refengine's engines that restore cached prefixes (both);
# an adapter without the feature skips those scenarios.
CACHING_ENGINES = ("reference", "async")


class LLMInstance:
    """refengine's LLM seen through the EngineInstance protocol (``llm.engine`` is the engine itself)."""

    def __init__(self, llm):
        self.llm = llm

    def add_request(self, request_id, prompt, params: RequestParams) -> None:
        self.llm.add_request(
            request_id,
            prompt,
            SamplingParams(
                max_tokens=params.max_tokens,
                ignore_eos=params.ignore_eos,
                stop_token_ids=list(params.stop_token_ids),
                **params.sampling,
            ),
        )

    def step(self):
        return self.llm.step()

    def has_unfinished(self) -> bool:
        return self.llm.has_unfinished()

    def abort(self, request_id: str):
        return self.llm.abort(request_id)

    def pools_empty(self) -> bool:
        return self.llm.engine.pools_empty()

    def occupancy(self) -> dict[str, int]:
        return dataclasses.asdict(self.llm.occupancy())


class RefEngineAdapter:
    """refengine's engines: ``LLM(engine="reference")`` or ``LLM(engine="async", graph_mode=...)``.

    The async engine runs with its hazard checker on and its copies delayed: a host buffer touched
    while its asynchronous copy is pending then fails the run deterministically (naming the buffer)
    instead of racing silently, and every pending copy lands as late as it can.

    Both declare "bitwise" (they run the reference's kernels: bitwise the reference engine in their own
    dtype on their own device). So under ``--verdict rescored`` against a reference in another dtype their
    bitwise checks are not given up but held to the reference engine in their own dtype
    (``conformance.verdict.Verdict.bitwise_in_own_dtype``); an adapter that does not declare it (vLLM's) has
    them n/a there.
    """

    def __init__(self, engine: str = "reference", graph_mode: str = "none", *, uncached: bool = False):
        """``uncached``: ignore a scenario's prefix-caching settings (the oracle runs without a cache)."""
        if graph_mode not in GRAPH_MODES:
            raise UnknownEngine(f"graph mode must be one of {GRAPH_MODES}, got {graph_mode!r}")
        self.engine = engine
        self.graph_mode = graph_mode
        self.uncached = uncached
        self.name = engine if engine == "reference" else f"async:{graph_mode}"

    def supports(self, feature: str) -> bool:
        if feature == "prefix_caching":
            return self.engine in CACHING_ENGINES and not self.uncached
        return feature in FEATURES

    def start(self, spec: RunSpec) -> EngineInstance:
        return LLMInstance(self.build(spec))

    def build(self, spec: RunSpec):
        from refengine import LLM
        from refengine.drafters import ScriptedDrafter

        if spec.tensor_parallel_size != 1:
            raise ValueError(f"{self.name}: runs on one device (tensor_parallel_size="
                             f"{spec.tensor_parallel_size} asked)")
        s = spec.settings if not self.uncached else spec.settings.uncached()
        drafter, lookup = "mtp", {}
        if s.drafter == "draft_model":
            drafter, lookup = "draft_model", {"draft_model": draft_model_path(spec.model, s.draft_model)}
        elif s.drafter == "scripted" and s.k:
            drafter = ScriptedDrafter(s.k, spec.vocab_size, s.pattern)
        elif s.drafter == "ngram":
            drafter, lookup = "ngram", {"prompt_lookup_min": s.prompt_lookup_min,
                                        "prompt_lookup_max": s.prompt_lookup_max}
        elif s.drafter in ("eagle", "eagle3") and s.k:
            from conformance.eagle_heads import head_for
            from refengine.tools.tiny_models import resolve_draft

            head = resolve_draft(s.drafter, s.draft_model) or head_for(spec.model, s.drafter)
            drafter, lookup = s.drafter, {"draft_model": head}
        checked = {"delay_copies": True, "hazard_check": True} if self.engine == "async" else {}
        return LLM(
            model=spec.model,
            engine=self.engine,
            graph_mode=self.graph_mode,
            num_speculative_tokens=s.k,
            drafter=drafter,
            **lookup,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            block_size=s.block_size,
            num_kv_blocks=s.num_kv_blocks,
            max_model_len=s.max_model_len,
            device=spec.device,
            dtype=spec.dtype,
            seed=spec.seed,
            observer=spec.observer,
            enable_prefix_caching=s.enable_prefix_caching,
            mamba_cache_mode=s.mamba_cache_mode,
            **checked,
        )


def draft_model_path(model: str | None, draft_model: str) -> str:
    """A scenario's draft model as a folder: ``cut:<layers>`` cuts the run's model (None: the embedded
    default model) to those layers, once (``refengine.tools.draft_model.cut_draft_model``)."""
    from refengine.tools.draft_model import CUT_PREFIX, cut_draft_model
    from refengine.tools.tiny_models import TINY_PREFIX, resolve_model, tiny_model_path

    if draft_model.startswith(TINY_PREFIX):
        return tiny_model_path(draft_model)
    if not draft_model.startswith(CUT_PREFIX):
        return draft_model
    from refengine.llm import default_model_path

    src = default_model_path() if model is None else resolve_model(model)
    return cut_draft_model(src, draft_model[len(CUT_PREFIX):])


def reference_adapter() -> RefEngineAdapter:
    """The side every engine is compared against: the reference engine, no graphs."""
    return RefEngineAdapter("reference", "none", uncached=True)


def cached_reference_adapter() -> RefEngineAdapter:
    """The reference engine with a scenario's prefix caching: what must equal the oracle (it without)."""
    return RefEngineAdapter("reference", "none")
