"""The reference engine: a step is schedule -> restore -> execute -> hold -> postprocess (commit, propose)
-> publish -> release.

Synchronous and readable: the runner rebuilds every step's inputs from request state, so what
this engine does defines correct behaviour for the async engine.

Prefix caching follows the prefix cache's step protocol (``refengine.prefix_cache.cache``) with plain
loops on the host; ``_step`` is its reference form. A request admitted on a hit gets its checkpoint
copied into s_0 before the step runs. After the step, its rows' blocks are held, the tokens are
committed and the drafts proposed (the MTP drafter writes its KV at the committed positions then),
and then every block boundary the rows' committed tokens reached is published, with the state the
step left there. Holding the blocks until then lets a request that finished in this step publish too.
"""

from __future__ import annotations

from refengine.cache import ModelCaches
from refengine.config import EngineConfig, torch_dtype
from refengine.core import EngineCore
from refengine.drafters import drafter_cache_specs, make_drafter
from refengine.engine import Engine
from refengine.outputs import StepRecord
from refengine.postprocess import RowOutcome, postprocess
from refengine.prefix_cache import Span
from refengine.reference.runner import ReferenceRunner, StepResult


class ReferenceEngine(Engine):
    def __init__(self, config: EngineConfig, model, model_config, tokenizer=None):
        k = config.speculative.num_speculative_tokens
        self.config = config
        self.model = model
        self.drafter = make_drafter(
            config.speculative, model_config.vocab_size, config.scheduler.max_model_len
        )
        if self.drafter is not None:
            self.drafter.check_model(model)
        self.drafter_kv = self.drafter is not None and self.drafter.uses_kv_cache
        self.core = EngineCore(config, model_config, tokenizer, drafter_kv_cache=self.drafter_kv,
                               drop_last_block=getattr(self.drafter, "drops_last_block", False))
        self.caches = ModelCaches(model_config, config.num_kv_blocks, config.cache.block_size,
                                  config.num_state_slots + config.num_state_checkpoints, k,
                                  torch_dtype(config.dtype), config.device, drafter_kv=self.drafter_kv,
                                  drafter_specs=drafter_cache_specs(self.drafter, model_config, k))
        self.runner = ReferenceRunner(model, self.caches, block_size=config.cache.block_size,
                                      num_speculative_tokens=k, drafter=self.drafter,
                                      recurrent_prefill_chunked=config.recurrent_prefill_chunked,
                                      device=config.device)
        self._steps = 0

    def _step(self) -> bool:
        core = self.core
        sched = core.scheduler.schedule()
        if not sched.rows:
            return False
        prefix = core.scheduler.prefix
        for r in sched.restores:  # restore: a hit's checkpoint goes into s_0 before the step reads it
            self.caches.restore_checkpoint(r.checkpoint, r.slot)
        result = self.runner.execute(sched, record_digests=bool(core.observers))
        outcomes = [RowOutcome(row, valid, len(row.draft_token_ids) if rec.kind == "decode" else None, lp,
                               plp)
                    for row, valid, rec, lp, plp in zip(sched.rows, result.valid_tokens, result.records,
                                                        result.logprobs, result.prompt_logprobs)]
        spans = self._spans(outcomes, result) if prefix is not None else []
        if prefix is not None:
            prefix.hold(spans)
        try:  # commit -> propose, written by the one post-step writer
            _, proposals = postprocess(core, outcomes, propose=lambda o: self.runner.propose(o, result))
            for rec, p in zip(result.records, proposals):
                if p is not None:
                    rec.drafter_input_ids = list(p.input_ids)
                    rec.next_draft_token_ids = [] if p.drafts is None else list(p.drafts)
            if prefix is not None:
                self._publish(prefix, spans)
        finally:  # a fault publishes nothing more; recovery recomputes from the committed tokens
            if prefix is not None:
                prefix.release(spans)
        core.record(StepRecord(self._steps, result.records, list(sched.preempted), "none", len(sched.rows),
                               result.metadata_shapes, list(sched.resumed)))
        self._steps += 1
        return True

    def _spans(self, outcomes: list[RowOutcome], result: StepResult) -> list[Span]:
        """Each row's committed span: a prefill chunk keeps its query, a verify row its kept tokens."""
        return [Span(o.request, start, o.row.num_tokens, o.num_kept, rec.kind == "prefill",
                     list(o.request.state_slots))
                for o, rec, start in zip(outcomes, result.records, result.num_computed_before)]

    def _publish(self, prefix, spans: list[Span]) -> None:
        """Publish what the step committed; copy the state at each boundary it reached into a checkpoint."""
        for c in prefix.publish(spans):
            slot = prefix.checkpoints.reserve(c.key)
            if slot is not None:
                self.caches.save_checkpoint(c.span.state_slots, c.column, slot)
