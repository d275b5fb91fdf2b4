"""Mutants: the seed bugs re-created in the async engine, to measure the suite's power.

Each mutant patches one engine *instance* after it is built (never a module or class), so two
engines in one process stay independent and the async engine's source is untouched. A mutant is
caught when any check of any scenario fails on it; ``run_mutants`` stops a mutant at its first
failing check and reports how long that took.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import fields, is_dataclass, replace

import torch

from conformance.engines import EngineInstance, LLMInstance, RefEngineAdapter, RunSpec
from conformance.mutants.base import Mutant
from conformance.mutants.draft_model import draft_model_mutants
from conformance.mutants.eagle import eagle_mutants
from conformance.mutants.mamba2 import MAMBA2_MUTANTS
from conformance.mutants.params import params_mutants
from conformance.mutants.sampling import sampling_mutants
from conformance.mutants.structured import structured_mutants
from kernels import PAD_SLOT_ID
from refengine.async_engine.inputs import StepRows
from refengine.async_engine.stream import HostBuffer
from refengine.prefix_cache import ROOT_KEY, next_key


class _PlanSnapshots:
    """Host values a mutant captures when the engine plans a step, handed over in plan order later.

    A mutant re-creates a host copy the engine deliberately does not keep (contracts 3 and 4 in
    refengine/README.md) and feeds it where the engine reads the device's authoritative value. The
    device runs steps in plan order, so the k-th step program run takes the k-th plan's values.
    """

    def __init__(self, engine, capture: Callable):
        self.values: deque = deque()
        plan = engine.planner.plan

        def planned(sched):
            before = capture(sched)
            result = plan(sched)
            self.values.append((result, [before[id(row.request)] for row in result.rows]))
            return result

        engine.planner.plan = planned

    def pop(self) -> tuple:
        """(plan, per-row values) of the oldest step not yet run."""
        return self.values.popleft()


def _stale_accepted(engine) -> None:
    """Seed 000: recurrent state offsets come from a host copy of the kept counts, one step stale.

    The host copy is what the host knew when it planned the step: the counts of the step it had
    processed last, which under asynchronous scheduling is the one before the step in flight.
    """
    # request id -> kept count (bonus included) the host last saw; keyed by the id string, not by
    # id(request): a finished request's object address can be handed to a new request, which would then
    # inherit its count and make the mutant's effect depend on the allocator.
    known: dict[str, int] = {}
    process = engine.process

    def processed(fut):
        finished = process(fut)
        for row, valid in zip(fut.plan.rows, fut.num_valid.tolist()):
            if row.samples:
                known[row.request.request_id] = valid
        return finished

    engine.process = processed
    stale = _PlanSnapshots(
        engine, lambda sched: {id(r.request): known.get(r.request.request_id, 1) for r in sched.rows}
    )
    runner = engine.runner
    prepare = runner.prepare

    def prepare_with_stale_counts(shape, rows, num_computed):
        step = prepare(shape, rows, num_computed)
        plan, values = stale.pop()
        values = values[: plan.num_decode]
        decode = step.recurrent.decode
        if values and decode is not None and decode.num_valid is not None:
            host = torch.tensor(values, dtype=torch.int32, device=decode.num_valid.device)
            decode.num_valid[: plan.num_decode] = host
            step.used_num_valid[: plan.num_decode] = host
        return step

    runner.prepare = prepare_with_stale_counts


def _pad(x: torch.Tensor, rows: int, value) -> torch.Tensor:
    extra = torch.full((rows - x.shape[0], *x.shape[1:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, extra])


def _token_count_metadata(engine) -> None:
    """Seed 000: FULL-graph per-request recurrent and attention metadata padded to the token count."""
    builder = engine.builder
    build = builder.build

    def build_by_tokens(shape, *tables):
        attn, recurrent = build(shape, *tables)
        rows = shape.num_tokens_padded
        if shape.mode.value != "full" or rows <= shape.num_reqs_padded:
            return attn, recurrent
        qsl = _pad(attn.query_start_loc, rows + 1, int(attn.query_start_loc[-1]))
        attn = replace(attn, query_start_loc=qsl, seq_lens=_pad(attn.seq_lens, rows, 0),
                       block_table=_pad(attn.block_table, rows, builder.state.sink_block))
        d = recurrent.decode
        recurrent.decode = replace(
            d,
            query_start_loc=qsl,
            state_indices=_pad(d.state_indices, rows, PAD_SLOT_ID),
            num_valid=None if d.num_valid is None else _pad(d.num_valid, rows, 1),
        )
        return attn, recurrent

    builder.build = build_by_tokens


def _short_prompt_as_decode(engine) -> None:
    """Seed 004: rows are classified by query length, so a new prompt of <= 1+K tokens is a decode."""
    k = engine.config.speculative.num_speculative_tokens
    place = engine.planner.place

    def place_by_length(sched):
        rows, num_decode, admitted = place(sched)
        short = [r for r in rows[num_decode:] if r.num_tokens <= 1 + k]
        rest = [r for r in rows[num_decode:] if r.num_tokens > 1 + k]
        return rows[:num_decode] + short + rest, num_decode + len(short), admitted

    engine.planner.place = place_by_length


def _optimistic_backup_token(engine) -> None:
    """Seed 002: the drafter's next token is read at the host's optimistic sequence length."""
    proposer = engine.runner.proposer
    if proposer is None or not hasattr(proposer, "next_token_ids"):
        return
    original = proposer.next_token_ids

    def next_token_ids(d):
        ids = torch.cat([original(d), torch.zeros(1, dtype=torch.int64, device=d.idx.device)])
        ids[d.last_kept()] = d.backup_token  # the host's token at the optimistic length: -1 for decodes
        return ids[: d.num_tokens_padded]

    proposer.next_token_ids = next_token_ids


def _shared_host_buffer(engine) -> None:
    """Seed 001: the step's inputs are staged in one persistent host buffer, rewritten every step.

    Under asynchronous scheduling the next step's inputs are written while this step's copy may
    still be pending: with copies delayed the device would read the next step's rows; the hazard
    checker stops the run at the rewrite, naming the buffer.
    """
    runner = engine.runner
    enqueue = runner.enqueue
    persistent = {}

    def enqueue_from_one_buffer(plan):
        if "buf" not in persistent:
            persistent["buf"] = HostBuffer(
                "step-inputs (persistent)", engine.stream, (4096, plan.inputs.tensor.shape[1]), torch.int64
            )
        buf = persistent["buf"]
        buf.write(plan.inputs.tensor[: plan.shape.num_reqs])
        plan.inputs = buf
        return enqueue(plan)

    runner.enqueue = enqueue_from_one_buffer


def _host_positions(engine) -> None:
    """Own (contract 4): positions come from the host's optimistic num_computed_tokens."""
    runner = engine.runner
    host = _PlanSnapshots(
        engine, lambda sched: {id(r.request): r.request.num_computed_tokens for r in sched.rows}
    )
    prepare = runner.prepare

    def prepare_from_host(shape, rows, num_computed):
        counts = num_computed.clone()
        plan, values = host.pop()
        for row, value in zip(plan.rows, values):
            counts[row.request.idx] = value
        return prepare(shape, rows, counts)

    runner.prepare = prepare_from_host


def _prefill_in_decode_graph(engine) -> None:
    """Own (contract 6): FULL-graph eligibility judged by query lengths alone."""
    graphs = engine.graphs
    dispatch = graphs.dispatch
    k = graphs.num_speculative_tokens

    def dispatch_by_length(query_lens, is_decode, num_draft_positions):
        if all(q == 1 + k for q in query_lens):
            is_decode = [True] * len(query_lens)
        return dispatch(query_lens, is_decode, num_draft_positions)

    graphs.dispatch = dispatch_by_length


def _pad_rows_on_a_real_slot(engine) -> None:
    """Own (contract 6): a FULL step's padding rows point at request slot 0 instead of nowhere."""
    runner = engine.runner
    prepare = runner.prepare

    def prepare_with_real_pads(shape, rows, num_computed):
        rows.idx.masked_fill_(rows.idx < 0, 0)  # padding rows now serve request slot 0
        return prepare(shape, rows, num_computed)

    runner.prepare = prepare_with_real_pads


def _zero_draft_rows_read_drafts(engine) -> None:
    """Own (contract 5): every sampling row is verified as if it carried K drafts, zero-draft rows too."""
    runner = engine.runner
    verify = runner.verify

    def verify_all_as_k(shape, rows, step, hidden):
        k = runner.num_speculative_tokens
        full = torch.full_like(rows.num_draft_positions, k)
        shape = replace(shape, num_logits=full.shape[0] * (k + 1))
        return verify(shape, replace(rows, num_draft_positions=full), replace(step, num_drafts=full), hidden)

    runner.verify = verify_all_as_k


def _accepted_off_by_one(engine) -> None:
    """Own (contract 1): the state offset handed to the recurrent kernels is one past the live state."""
    runner = engine.runner
    prepare = runner.prepare

    def prepare_off_by_one(shape, rows, num_computed):
        step = prepare(shape, rows, num_computed)
        decode = step.recurrent.decode
        if decode is not None and decode.num_valid is not None:
            decode.num_valid.add_(1).clamp_(max=runner.num_speculative_tokens + 1)
        return step

    runner.prepare = prepare_off_by_one


def _zero_draft_reads_first_slot(engine) -> None:
    """vLLM #52942: a decode row with no drafts takes the non-speculative path, which reads the state
    from the first slot s_0; after a step that accepted drafts the live state is s_{a-1}, so the
    recurrent layers start from a state that lacks the accepted tokens."""
    runner = engine.runner
    prepare = runner.prepare

    def prepare_zero_draft_as_plain_decode(shape, rows, num_computed):
        step = prepare(shape, rows, num_computed)
        decode = step.recurrent.decode
        if decode is not None and decode.num_valid is not None:
            nd = decode.num_valid.shape[0]
            none = step.num_drafts[:nd] == 0
            decode.num_valid.masked_fill_(none, 1)
            step.used_num_valid[:nd].masked_fill_(none, 1)
        return step

    runner.prepare = prepare_zero_draft_as_plain_decode


def _zero_draft_keeps_offset(engine) -> None:
    """Own (contract 1): a step that verified no drafts leaves the request's state offset as it was,
    though it kept one token (the live state is now s_0), so the next step reads a stale slot."""
    runner, st = engine.runner, engine.runner.state
    commit = runner.commit

    def commit_skipping_zero_draft_rows(rows, v):
        idx = rows.idx
        before = st.num_valid[idx].clone()
        none = rows.is_decode.bool() & (st.num_drafts[idx] == 0)  # the drafts this step verified
        commit(rows, v)
        st.num_valid[idx] = torch.where(none, before, st.num_valid[idx])

    runner.commit = commit_skipping_zero_draft_rows


def _drafts_counted_from_host(engine) -> None:
    """Own (contract 5): a decode row verifies, and reports, the K draft positions the host scheduled
    instead of the drafts the device proposed, fillers included."""
    runner = engine.runner
    prepare = runner.prepare

    def prepare_with_host_count(shape, rows, num_computed):
        step = prepare(shape, rows, num_computed)
        step.num_drafts.copy_(torch.where(rows.is_decode.bool(), rows.num_draft_positions, step.num_drafts))
        return step

    runner.prepare = prepare_with_host_count


def _select(staged, keep: torch.Tensor):
    """``staged`` (an ``Admission`` or a drafter's staged tables) at rows ``keep``."""
    if staged is None or not is_dataclass(staged):
        return staged
    return replace(staged, **{f.name: _select_value(getattr(staged, f.name), keep) for f in fields(staged)})


def _select_value(value, keep: torch.Tensor):
    if isinstance(value, torch.Tensor):
        return value[keep]
    return _select(value, keep)


def _resume_without_reset(engine) -> None:
    """Own (contract 2): a request resumed after preemption keeps the device row of its old slot.

    Wraps ``StepPlanner.plan``: the admission of a resumed request is dropped from the step's staged
    writes (``admit.*`` pieces, and the drafter's staged tables), so its device row is never reset."""
    plan = engine.planner.plan

    def admit_fresh_only(sched):
        result = plan(sched)
        w = result.writes
        idx = w.get("admit.idx")
        if idx is None:
            return result
        resumed = {row.request.idx for row in result.rows if row.request.num_preemptions}
        keep = torch.tensor([i for i, x in enumerate(idx.tolist()) if x not in resumed], dtype=torch.int64)
        if len(keep) == len(idx):
            return result
        for name in [n for n in w.pieces if n.startswith("admit.")]:
            if len(keep):
                w.replace(name, w.pieces[name][keep])
            else:
                del w.pieces[name]
        result.drafter_admission = _select(result.drafter_admission, keep) if len(keep) else None
        return result

    engine.planner.plan = admit_fresh_only


def _preempted_keeps_placeholders(engine) -> None:
    """Own (contract 4): a preempted request keeps its optimistic placeholder tokens."""
    engine.core.scheduler.on_preempt = lambda req: None


def _stop_rule_on_optimistic_count(engine) -> None:
    """Own (contract 4): the max_tokens stop rule counts the host's optimistic placeholders."""
    core = engine.core
    stop_reason = core.stop_reason

    def stop_with_placeholders(req, token):
        reason = stop_reason(req, token)
        if (
            reason is None
            and len(req.output_token_ids) + req.num_output_placeholders >= req.params.max_tokens
        ):
            return "length"
        return reason

    core.stop_reason = stop_with_placeholders


def _publish_optimistic_count(engine) -> None:
    """Prefix caching: a verify row publishes up to its scheduled tokens, as if every draft was kept.

    Wraps ``AsyncPrefixCache.spans`` (processing: the committed span of each row, before the protocol's
    hold and publish)."""
    if engine.prefix is None:  # caching is off: nothing to break
        return
    prefix = engine.prefix
    spans_of = prefix.spans

    def spans_optimistically(plan, tokens, discarded):
        spans = spans_of(plan, tokens, discarded)
        for span in spans:
            if not span.is_prefill:
                span.kept = span.num_tokens
        return spans

    prefix.spans = spans_optimistically


def _kv_hit_past_checkpoint(engine) -> None:
    """Prefix caching: a hit is as long as its cached KV blocks, restoring the last checkpoint inside it
    (or none), so computation resumes past the position the restored state belongs to.

    Wraps ``PrefixCache.find`` (admission: the lookup)."""
    if engine.prefix is None:  # caching is off: nothing to break
        return
    prefix = engine.core.scheduler.prefix
    find = prefix.find

    def find_by_kv(req, total):
        hit = find(req, total)
        shared = hit.num_shared // prefix.block_size
        if shared <= len(hit.blocks):
            return hit
        blocks = [prefix.kv_pool.lookup(key) for key in prefix.keys(req)[:shared]]
        return replace(hit, num_tokens=shared * prefix.block_size, blocks=blocks)

    prefix.find = find_by_kv


def _hit_without_reference(engine) -> None:
    """Prefix caching: a hit shares its KV blocks without a reference of its own, so the pool may evict
    and reuse them while the request still reads them (and frees them once too often).

    Wraps ``Scheduler.schedule`` (admission: the hits it restores)."""
    if engine.prefix is None:  # caching is off: nothing to break
        return
    scheduler = engine.core.scheduler
    schedule = scheduler.schedule

    def schedule_without_taking():
        out = schedule()
        hits = {r.request_id for r in out.restores}  # admitted on a hit by this call
        for row in out.rows:
            req = row.request
            if req.request_id in hits:
                scheduler.kv_pool.free(req.block_ids[: req.num_computed_tokens // scheduler.block_size])
        return out

    scheduler.schedule = schedule_without_taking


def _restore_repeated(engine) -> None:
    """Prefix caching: a hit's restore copy is queued again with the request's next step, so it runs
    back over the newer state the request's first step left in s_0.

    Wraps ``StepPlanner.plan`` (the protocol's restore, staged with the step's writes)."""
    if engine.prefix is None:  # caching is off: nothing to break
        return
    plan = engine.planner.plan
    pending: dict[str, tuple[int, int]] = {}  # request id -> (checkpoint slot, s_0) restored last step

    def plan_with_a_stale_restore(sched):
        hits = {r.request_id: (r.checkpoint, r.slot) for r in sched.restores}
        result = plan(sched)
        ids = [row.request.request_id for row in result.rows]
        again = [pending.pop(rid) for rid in ids if rid in pending]
        pending.clear()
        pending.update(hits)
        if again:
            stale = torch.tensor(again, dtype=torch.int64)
            restores = result.writes.get("restores")
            result.writes.replace("restores", stale if restores is None else torch.cat([restores, stale]))
        return result

    engine.planner.plan = plan_with_a_stale_restore


def _checkpoint_slots_in_schedule_order(engine) -> None:
    """Prefix caching: the checkpoint slots held per row are staged in scheduling order while the step
    program reads them in batch order, so after rows move a row's state lands in another's checkpoint.

    Wraps ``StepPlanner.plan`` (planning: the row table's ``checkpoint_slots`` columns, staged for the
    device; the host keys the slots by batch row as before)."""
    if engine.prefix is None:  # caching is off: nothing to break
        return
    plan = engine.planner.plan
    first = len(StepRows.columns())  # the checkpoint_slots columns come after the one-column fields

    def plan_in_schedule_order(sched):
        result = plan(sched)
        where = {id(row.request): i for i, row in enumerate(result.rows)}
        order = torch.tensor([where[id(r.request)] for r in sched.rows], dtype=torch.int64)
        table = result.inputs.tensor[: len(result.rows)]
        table[:, first:] = table[order, first:].clone()
        return result

    engine.planner.plan = plan_in_schedule_order


def _stale_kept_counts_for_checkpoints(engine) -> None:
    """Prefix caching: the checkpoint copy masks with a per-batch-row copy of the kept counts that is one
    step stale (and, once rows move, another request's), so a boundary a row kept is skipped (the host
    keys a slot nothing was copied into) or a rejected one is copied.

    Wraps ``AsyncRunner.checkpoint`` (the step program's checkpoint stage)."""
    if engine.prefix is None:  # caching is off: nothing to break
        return
    runner = engine.runner
    checkpoint = runner.checkpoint
    previous: list[torch.Tensor] = []  # [Np] kept counts of the last step, by batch row

    def checkpoint_with_stale_counts(rows, step, v):
        counts = v.num_valid.clone()
        if previous:
            n = min(counts.shape[0], previous[0].shape[0])
            counts[:n] = previous[0][:n]
        previous[:] = [v.num_valid.clone()]
        checkpoint(rows, step, replace(v, num_valid=counts))

    runner.checkpoint = checkpoint_with_stale_counts


def _conv_window_unshifted(engine) -> None:
    """Prefix caching: a checkpoint takes the conv window's first W-1 columns, not the ones that end at
    the boundary's token, so a verify step's checkpoint has the window of the step's first token.

    Wraps ``ModelCaches.save_checkpoints`` (the step program's checkpoint copy)."""
    if engine.prefix is None:  # caching is off: nothing to break
        return
    caches = engine.caches
    save = caches.save_checkpoints

    def save_unshifted(slot0, column, src, dst):
        save(slot0, torch.zeros_like(column), src, dst)

    caches.save_checkpoints = save_unshifted


def _evict_newest(engine) -> None:
    """Prefix caching: when the KV pool has no never-used block left it evicts the most recently released
    cached block instead of the least recently released one, so the prefix a request just left goes
    first and the next request that shares it hits less (never wrongly: every hit is still correct)."""
    if engine.prefix is None:  # caching is off: nothing to break
        return
    pool = engine.core.scheduler.kv_pool

    def allocate_evicting_newest(n):
        if n > pool.num_free:
            return None
        ids = []
        for _ in range(n):
            if pool._free:
                block = pool._free.pop()
            else:
                block, _ = pool._evictable.popitem(last=True)
                del pool._block_of[pool._key_of.pop(block)]
            pool._refs[block] = 1
            ids.append(block)
        return ids

    pool.allocate = allocate_evicting_newest


def _chunk_end_pairs_own_token(engine) -> None:
    """Contract 5: the drafter's entry at the last position of a prompt chunk that ends inside a KV block
    is paired with that position's own token instead of the prompt token after it (the host-staged
    backup token). The drafter's cache holds one wrong pair per such chunk, which the drafts read only
    through attention: they seldom change."""
    proposer = engine.runner.proposer
    if proposer is None or not hasattr(proposer, "next_token_ids"):
        return
    original = proposer.next_token_ids
    block_size = engine.config.cache.block_size

    def next_token_ids(d):
        ids = original(d)
        last = d.last_kept()
        chunk = (~d.is_sampling) & (last < d.num_tokens_padded)
        last = last[chunk]
        last = last[(d.positions[last] + 1) % block_size != 0]
        ids[last] = d.input_ids[last]
        return ids

    proposer.next_token_ids = next_token_ids


def _keys_without_parent(engine) -> None:
    """Prefix caching: a block's key covers its own tokens (and the lookahead) but not the key of the block
    before it, so equal blocks at different offsets, or after different prefixes, share one key: a prompt
    finds another prompt's block, with its KV and its checkpoint, where only the block's tokens match."""
    if engine.prefix is None:  # caching is off: nothing to break
        return
    prefix = engine.core.scheduler.prefix
    bs, lookahead = prefix.block_size, prefix.lookahead

    def keys_of_blocks_alone(req):
        keys, tokens = req.block_keys, req.all_token_ids
        while (len(keys) + 1) * bs + lookahead <= len(tokens):
            i = len(keys)
            keys.append(next_key(ROOT_KEY, tokens[i * bs: (i + 1) * bs + lookahead]))
        return keys

    prefix.keys = keys_of_blocks_alone


def _staging_for_one_step(engine) -> None:
    """Prefix caching: checkpoint staging slots are held for one step in flight only: while a step that
    holds some is in flight, the next step's rows get none, so the boundaries they reach go unpublished
    (their copies land in the sink) and later requests hit less, never wrongly."""
    if engine.prefix is None:  # caching is off: nothing to break
        return
    cache = engine.prefix
    checkpoints = cache.prefix.checkpoints
    hold = checkpoints.hold

    def hold_while_no_step_holds():
        return None if any(cache._held.values()) else hold()

    checkpoints.hold = hold_while_no_step_holds


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "stale-accepted-counts",
        "seed 000 (vLLM #45100)",
        "contract 3: accepted counts keyed by request",
        "recurrent state offsets read from a per-row host copy of the kept counts, stale after rows move",
        _stale_accepted,
        scenarios=("churn-k3", "scripted-ragged-k3"),
    ),
    Mutant(
        "token-count-gdn-metadata",
        "seed 000 (vLLM #45100)",
        "contract 6: FULL-graph metadata sized by requests",
        "FULL-graph per-request tensors padded to the token count instead of the request count",
        _token_count_metadata,
        graph_mode="full",
        scenarios=("graph-padding-k1",),
    ),
    Mutant(
        "short-prompt-as-decode",
        "seed 004 (vLLM #32716)",
        "contract 2: classification by context",
        "a new prompt of at most 1+K tokens is classified as a decode and skips state initialisation",
        _short_prompt_as_decode,
        scenarios=("short-prompts-k3", "short-prompts-mixed-k3"),
    ),
    Mutant(
        "optimistic-backup-token",
        "seed 002 (vLLM #38556)",
        "contract 5: drafter inputs are committed tokens",
        "the drafter's next token is read at the optimistic (placeholder-inflated) sequence length",
        _optimistic_backup_token,
        scenarios=("mtp-k3",),
    ),
    Mutant(
        "shared-host-buffer",
        "seed 001 (async scheduling x spec decode)",
        "contract 7: host buffers",
        "the step inputs are staged in one host buffer that the next step rewrites while the copy is pending",
        _shared_host_buffer,
        scenarios=("chunk-tails-k3",),
    ),
    Mutant(
        "host-optimistic-positions",
        "own",
        "contract 4: num_computed_tokens is device-authoritative",
        "positions and slot mappings built from the host's optimistic num_computed_tokens",
        _host_positions,
        scenarios=("scripted-ragged-k3", "churn-k3"),
    ),
    Mutant(
        "prefill-in-decode-graph",
        "own",
        "contract 6: no decode graph for a batch with a prefill",
        "a batch whose prefill rows happen to have 1+K tokens replays the uniform-decode FULL graph",
        _prefill_in_decode_graph,
        graph_mode="full",
        scenarios=("short-prompts-mixed-k3",),
    ),
    Mutant(
        "pad-rows-on-a-real-slot",
        "own",
        "contract 6: padding rows are inert",
        "a FULL step's padding rows point at request slot 0, so they write its state and tokens",
        _pad_rows_on_a_real_slot,
        graph_mode="full",
        scenarios=("mtp-k1",),
    ),
    Mutant(
        "zero-draft-rows-read-drafts",
        "own",
        "contract 5: drafts are what was proposed",
        "rows that carry no drafts (a finished prefill) are verified against K stale draft columns",
        _zero_draft_rows_read_drafts,
        scenarios=("mtp-k3", "chunk-tails-k3"),
    ),
    Mutant(
        "zero-draft-reads-first-slot",
        "vLLM #52942",
        "contract 1: the live state is s_{a-1}",
        "a decode row with no drafts reads the state of slot s_0, not that of the last accepted token",
        _zero_draft_reads_first_slot,
        scenarios=("ngram-k3", "ngram-k1", "scripted-zero-draft-k3"),
    ),
    Mutant(
        "zero-draft-keeps-offset",
        "own",
        "contract 1: the live state is s_{a-1}",
        "a step that verified no drafts leaves the state offset of the step before it",
        _zero_draft_keeps_offset,
        scenarios=("ngram-k3", "ngram-k1", "scripted-zero-draft-k3"),
    ),
    Mutant(
        "drafts-counted-from-host",
        "own",
        "contract 5: only the drafts proposed are verified",
        "a decode row verifies and reports the host's K draft positions, fillers included",
        _drafts_counted_from_host,
        graph_mode="full",
        scenarios=("ngram-k1", "ngram-k3", "scripted-zero-draft-k3"),
    ),
    Mutant(
        "accepted-count-off-by-one",
        "own",
        "contract 1: the live state is s_{a-1}",
        "the recurrent kernels read the state slot one past the live one",
        _accepted_off_by_one,
        scenarios=("mtp-k3", "scripted-ragged-k3"),
    ),
    Mutant(
        "resume-without-reset",
        "own",
        "contract 2: a resumed request starts from zero",
        "a request readmitted after preemption keeps its request slot's old device row",
        _resume_without_reset,
        scenarios=("preemption-k3", "preemption-k0"),
    ),
    Mutant(
        "preempted-keeps-placeholders",
        "own",
        "contract 4: optimistic counts never steer recompute",
        "a preempted request keeps its optimistic placeholders and recomputes a wrong prefix",
        _preempted_keeps_placeholders,
        scenarios=("preemption-k3",),
    ),
    Mutant(
        "stop-rule-on-optimistic-count",
        "own",
        "contract 4: host copies are upper bounds only",
        "the max_tokens stop rule counts optimistic placeholders, so requests stop early",
        _stop_rule_on_optimistic_count,
        scenarios=("mtp-k3", "churn-k3"),
    ),
    Mutant(
        "pc-publish-optimistic-count",
        "own (prefix caching)",
        "contract 9: published once committed",
        "a verify row publishes the block and checkpoint its scheduled drafts would reach, holding a "
        "rejected draft's KV and a state never copied",
        _publish_optimistic_count,
        scenarios=("pc-preemption-k3",),
    ),
    Mutant(
        "pc-kv-hit-past-checkpoint",
        "own (prefix caching)",
        "contract 9: the state at the hit's position",
        "a hit is as long as its cached KV blocks and restores the last checkpoint inside them (or none)",
        _kv_hit_past_checkpoint,
        scenarios=("pc-shared-prompt-k0-align", "pc-shared-prompt-k3-align"),
    ),
    Mutant(
        "pc-hit-without-reference",
        "own (prefix caching)",
        "contract 9: a hit references its blocks",
        "the KV blocks of a hit are shared without taking a reference, so eviction can reuse them while "
        "shared",
        _hit_without_reference,
        scenarios=("pc-shared-prompt-k0-all",),
    ),
    Mutant(
        "pc-restore-repeated",
        "vLLM #53505 (copy over newer state)",
        "contract 9: never over newer state",
        "a hit's restore copy is queued again with the request's next step and overwrites the state its "
        "first step left",
        _restore_repeated,
        scenarios=("pc-shared-prompt-k3-all",),
    ),
    Mutant(
        "pc-checkpoint-slots-permuted",
        "own (prefix caching; the #53919 family)",
        "contract 9: each checkpoint from its own row",
        "the checkpoint slots held per row are staged in scheduling order but read in batch order",
        _checkpoint_slots_in_schedule_order,
        scenarios=("pc-shared-prompt-k3-all", "pc-shared-prompt-k0-all"),
    ),
    Mutant(
        "pc-stale-kept-counts",
        "vLLM #53919 (kept counts permuted when rows move)",
        "contracts 3 and 9: kept counts keyed by request",
        "the checkpoint copy masks with the kept counts the previous step left at the same batch row",
        _stale_kept_counts_for_checkpoints,
        scenarios=("pc-preemption-k3",),
    ),
    Mutant(
        "pc-conv-window-unshifted",
        "own (prefix caching)",
        "contracts 1 and 9: the state after token j",
        "a verify step's checkpoint takes the conv window of its first token, not of the boundary's token",
        _conv_window_unshifted,
        scenarios=("pc-preemption-k3",),
    ),
)


MUTANTS += (
    Mutant(
        "pc-evict-newest",
        "own (prefix caching; under-hit)",
        "contract 9: a cache that silently stops hitting is a failure",
        "a KV pool out of never-used blocks evicts the most recently released cached block, not the least",
        _evict_newest,
        scenarios=("prefix-eviction-order-k0",),
    ),
    Mutant(
        "chunk-end-drafter-token",
        "own (drafter inputs)",
        "contract 5: drafter inputs are committed tokens",
        "the drafter pairs the last position of a prompt chunk ending inside a block with its own token, "
        "not the prompt token after it",
        _chunk_end_pairs_own_token,
        scenarios=("chunk-tails-k3",),
    ),
    Mutant(
        "pc-keys-without-parent",
        "own (prefix caching; block geometry)",
        "contract 9: a hit is a prefix",
        "a block's key covers its own tokens but not the block before it: equal blocks at other offsets hit",
        _keys_without_parent,
        scenarios=("prefix-offset-blocks-k0",),
    ),
    Mutant(
        "pc-staging-one-step",
        "own (prefix caching; under-hit)",
        "contract 9: a cache that silently stops hitting is a failure",
        "checkpoint staging slots are held for one step in flight: the next step's boundaries go unpublished",
        _staging_for_one_step,
        scenarios=("prefix-eviction-order-k0",),
    ),
)


MUTANTS += MAMBA2_MUTANTS  # the Mamba2 bug record
MUTANTS += params_mutants()  # requests that carry state (issue 34)
MUTANTS += structured_mutants()
MUTANTS += draft_model_mutants()  # draft models (issue 35)
MUTANTS += sampling_mutants()  # seeded sampling and rejection sampling (issue 37)
MUTANTS += eagle_mutants(_shared_host_buffer)  # EAGLE-1 and EAGLE-3 drafters (issue 35)


def get_mutant(mutant_id: str) -> Mutant:
    for m in MUTANTS:
        if m.id == mutant_id:
            return m
    raise KeyError(f"unknown mutant {mutant_id!r}; known: {', '.join(m.id for m in MUTANTS)}")


class MutantAdapter(RefEngineAdapter):
    """The async engine, built exactly as the conformance adapter builds it, with one mutant applied."""

    def __init__(self, mutant: Mutant):
        super().__init__("async", mutant.graph_mode)
        self.mutant = mutant
        self.name = f"mutant:{mutant.id}"

    def start(self, spec: RunSpec) -> EngineInstance:
        llm = self.build(spec)
        self.mutant.patch(llm.engine)
        return LLMInstance(llm)
