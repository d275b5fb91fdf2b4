"""Continuous batching with chunked prefill, speculative verify rows and preemption by recompute.

Every step has one token budget. Running requests are served first, in admission order: a
request's query is everything it has not computed yet plus its drafts
(``num_tokens + len(drafts) - num_computed_tokens``). Prompts are chunked to the budget; a verify
row runs whole or waits, so acceptance never depends on the budget. Waiting requests are
admitted after that while seats, budget, blocks and state slots last. When KV blocks run out, the
most recently admitted running request is preempted: its blocks and slots are freed and it starts
over from its prompt plus the tokens it already produced.

With prefix caching (``refengine.prefix_cache``) an admission first looks up the longest cached
prefix: its KV blocks are shared (one more reference each), ``num_computed_tokens`` starts after it
and the step's output carries a ``Restore``: the checkpoint the engine copies into s_0 before the
step runs. Prefill chunks are clipped to the mode's checkpoint boundaries.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from refengine.config import EngineConfig
from refengine.pools import StateSlotPool
from refengine.prefix_cache import BlockPool, CheckpointPool, Hit, PrefixCache, Restore
from refengine.request import Request, RequestStatus


@dataclass
class ScheduledRow:
    request: Request
    num_tokens: int  # query length: committed tokens not yet computed, then drafts
    draft_token_ids: list[int]  # the drafts at the tail of the query
    samples: bool  # the row reaches the request's last token, so its logits pick the next tokens

    @property
    def num_committed(self) -> int:
        return self.num_tokens - len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    rows: list[ScheduledRow] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids sent back to the waiting queue
    resumed: list[str] = field(default_factory=list)  # request ids readmitted after a preemption
    restores: list[Restore] = field(default_factory=list)  # checkpoints to copy into s_0 before the step

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


def committed_tokens(req: Request) -> int:
    return req.num_tokens


class Scheduler:
    """One scheduler for both engines; what differs between them comes in as parameters.

    ``num_tokens(req)``: the tokens the scheduler treats as the request's sequence (the async engine
    counts its not-yet-confirmed placeholder tokens too). ``on_release(req)`` runs after a request's
    blocks and slots went back to the pools (finish, abort or preemption); ``on_preempt(req)`` after
    a request was sent back to the waiting queue. ``drafter_kv_cache``: the drafter keeps a KV cache
    whose entry at a position pairs it with the next token, so block keys cover one token more.
    ``drop_last_block``: the drafter keeps such a KV cache under vLLM's rule instead (EAGLE): keys cover a
    block's own tokens and a hit drops its last matched block.
    """

    def __init__(self, config: EngineConfig, *, num_tokens: Callable[[Request], int] = committed_tokens,
                 on_release: Callable[[Request], None] | None = None,
                 on_preempt: Callable[[Request], None] | None = None, drafter_kv_cache: bool = False,
                 drop_last_block: bool = False):
        self.config = config
        self.num_tokens = num_tokens
        self.on_release = on_release
        self.on_preempt = on_preempt
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.budget = config.scheduler.max_num_batched_tokens
        self.block_size = config.cache.block_size
        self.num_slots_per_request = 1 + config.speculative.num_speculative_tokens
        self.lookahead = config.num_lookahead_tokens
        # The async engine's optimistic counts can run past what a request ever writes; never reserve
        # beyond it.
        self.max_kv_positions = config.kv_positions_per_request
        self.kv_pool = BlockPool(config.num_kv_blocks)
        self.slot_pool = StateSlotPool(config.num_state_slots)
        self.prefix: PrefixCache | None = None
        if config.cache.enable_prefix_caching:
            checkpoints = CheckpointPool(config.num_state_slots, config.num_state_checkpoints,
                                         config.num_staged_checkpoints)
            self.prefix = PrefixCache(self.kv_pool, checkpoints, self.block_size,
                                      config.cache.mamba_cache_mode, lookahead=1 if drafter_kv_cache else 0,
                                      drop_last_block=drop_last_block)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            uncomputed = self.num_tokens(req) - req.num_computed_tokens
            if req.is_prefilling:
                num_new = self._clip(req, min(uncomputed, budget))  # prompts are chunked to the budget
            else:
                num_new = uncomputed + len(req.draft_token_ids)
                if num_new > budget:  # verify rows run whole, so acceptance never depends on the budget
                    i += 1
                    continue
            if not self._reserve_blocks(req, num_new, out):
                continue  # ``req`` itself was preempted; running[i] is now the next request
            drafts = [] if req.is_prefilling else list(req.draft_token_ids)
            out.rows.append(ScheduledRow(req, num_new, drafts, samples=num_new - len(drafts) == uncomputed))
            budget -= num_new
            i += 1

        while self.waiting and not out.preempted and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            total = self.num_tokens(req)
            # vLLM reads no cached prefix for a request asking prompt logprobs (it would lose their entries)
            lookup = self.prefix is not None and req.params.prompt_logprobs is None
            hit = self.prefix.find(req, total) if lookup else Hit(0, [], None)
            self.kv_pool.take(hit.blocks)  # before allocating, so eviction cannot hand them out
            req.block_ids, req.num_computed_tokens = list(hit.blocks), hit.num_tokens
            req.num_shared_tokens = hit.num_shared
            num_new = self._clip(req, min(total - req.num_computed_tokens, budget), total)
            blocks = self.kv_pool.allocate(self._blocks_needed(req, num_new))
            slots = self.slot_pool.allocate(self.num_slots_per_request) if blocks is not None else None
            if slots is None:
                self.kv_pool.free(hit.blocks + (blocks or []))
                req.block_ids, req.num_computed_tokens, req.num_shared_tokens = [], 0, 0
                break
            self.waiting.popleft()
            req.block_ids += blocks
            req.state_slots = slots
            if hit.checkpoint is not None:
                out.restores.append(Restore(req.request_id, hit.checkpoint, slots[0]))
            if lookup:  # a request that skipped the lookup is not counted (as vLLM's stats)
                self.prefix.count(total, hit)
            if req.num_cached_tokens is None:
                req.num_cached_tokens = hit.num_tokens
            req.num_prefill_tokens = total
            req.status = RequestStatus.RUNNING
            if req.num_preemptions:
                out.resumed.append(req.request_id)
            self.running.append(req)
            out.rows.append(
                ScheduledRow(req, num_new, [], samples=req.num_computed_tokens + num_new == total)
            )
            budget -= num_new
        return out

    def _clip(self, req: Request, num_new: int, total: int | None = None) -> int:
        if self.prefix is None:
            return num_new
        total = req.num_prefill_tokens if total is None else total
        return self.prefix.clip(req.num_computed_tokens, num_new, total, req.num_shared_tokens)

    def _blocks_needed(self, req: Request, num_new: int) -> int:
        total = min(req.num_computed_tokens + num_new + self.lookahead, self.max_kv_positions)
        return max(math.ceil(total / self.block_size) - len(req.block_ids), 0)

    def _reserve_blocks(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Grow ``req``'s block list, preempting from the tail of ``running``; False if ``req`` itself
        went."""
        while True:
            blocks = self.kv_pool.allocate(self._blocks_needed(req, num_new))
            if blocks is not None:
                req.block_ids.extend(blocks)
                return True
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False

    def preempt_all(self) -> list[str]:
        """Send every running request back to the waiting queue (it recomputes from its committed tokens).

        Engines call this after a fault inside a step: whatever the step left half-written (KV
        entries, state slots, device rows), a request that starts over from its committed tokens
        reads none of it, so its output stays exact.
        """
        preempted = [r.request_id for r in self.running]
        for req in reversed(list(self.running)):
            self._preempt(req)
        return preempted

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_prefill_tokens = 0
        req.num_shared_tokens = 0
        req.draft_token_ids = []
        req.num_valid = 1
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        if self.on_preempt is not None:
            self.on_preempt(req)

    def _release(self, req: Request) -> None:
        self.kv_pool.free(req.block_ids)
        self.slot_pool.free(req.state_slots)
        req.block_ids, req.state_slots = [], []
        if self.on_release is not None:
            self.on_release(req)

    def finish(self, req: Request, reason: str) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._release(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.draft_token_ids = []
