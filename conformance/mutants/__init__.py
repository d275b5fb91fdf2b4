"""Mutants: the seed bugs re-created in the async engine, to measure the suite's power.

Each mutant patches one engine *instance* after it is built (never a module or class), so two
engines in one process stay independent and the async engine's source is untouched. A mutant is
caught when any check of any scenario fails on it; ``run_mutants`` stops a mutant at its first
failing scenario and reports how long that took.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from conformance.engines import EngineInstance, LLMInstance, RefEngineAdapter, RunSpec


@dataclass(frozen=True)
class Mutant:
    id: str
    origin: str  # the seed pull request, or "own" for the other contracts of refengine/README.md
    contract: str  # the contract of refengine/README.md it breaks
    description: str
    patch: Callable  # patch(engine) -> None, applied to a refengine.async_engine.AsyncEngine instance
    graph_mode: str = "full_and_piecewise"
    scenarios: tuple[str, ...] = ()  # scenario ids tried first (the rest of the tier follows)


class _PlanSnapshots:
    """Host values a mutant captures when the engine plans a step, looked up by plan index later.

    A mutant re-creates a host copy the engine deliberately does not keep (contracts 3 and 4 in refengine/README.md)
    and feeds it where the engine reads the device's authoritative value.
    """

    def __init__(self, engine, capture: Callable):
        self.values: dict[int, list] = {}
        plan = engine.plan

        def planned(sched):
            before = capture(sched)
            result = plan(sched)
            self.values[result.index] = [before[id(row.request)] for row in result.rows]
            return result

        engine.plan = planned

    def pop(self, plan_index: int) -> list:
        return self.values.pop(plan_index)


def _stale_accepted(engine) -> None:
    """Seed 000: GDN state offsets come from a host copy of the accepted counts, one step stale.

    The host copy is what the host knew when it planned the step: the counts of the step it had
    processed last, which under asynchronous scheduling is the one before the step in flight.
    """
    known: dict[int, int] = {}  # id(request) -> accepted count (bonus included) the host last saw
    process = engine._process

    def processed(fut):
        finished = process(fut)
        for row, valid in zip(fut.plan.rows, fut.num_valid.tolist()):
            if row.samples:
                known[id(row.request)] = valid
        return finished

    engine._process = processed
    stale = _PlanSnapshots(engine, lambda sched: {id(r.request): known.get(id(r.request), 1) for r in sched.rows})
    runner = engine.runner
    prepare = runner.prepare

    def prepare_with_stale_counts(plan, rows, num_computed):
        step = prepare(plan, rows, num_computed)
        values = stale.pop(plan.index)[: plan.num_decode]
        decode = step.recurrent.decode
        if values and decode is not None and decode.num_accepted_tokens is not None:
            host = torch.tensor(values, dtype=torch.int32, device=decode.num_accepted_tokens.device)
            decode.num_accepted_tokens[: plan.num_decode] = host
            step.used_accepted[: plan.num_decode] = host
        return step

    runner.prepare = prepare_with_stale_counts


def _token_count_metadata(engine) -> None:
    """Seed 000: FULL-graph per-request GDN metadata padded to the token count."""
    engine.builder.per_request_rows = lambda shape: shape.num_tokens_padded


def _short_prompt_as_decode(engine) -> None:
    """Seed 004: rows are classified by query length, so a new prompt of <= 1+K tokens is a decode."""
    k = engine.config.speculative.num_speculative_tokens
    engine.is_decode = lambda row: row.num_tokens <= 1 + k or not row.request.is_prefilling


def _optimistic_backup_token(engine) -> None:
    """Seed 002: the drafter's next token is read at the host's optimistic sequence length."""
    proposer = engine.runner.proposer
    if proposer is None or not hasattr(proposer, "next_token_ids"):
        return
    original = proposer.next_token_ids

    def next_token_ids(d):
        ids = original(d)
        last = d.query_start_loc[:-1].long() + d.kept - 1
        ids[last] = d.backup_token  # the host's token at the optimistic length: a placeholder (-1) for decodes
        return ids

    proposer.next_token_ids = next_token_ids


def _shared_host_buffer(engine) -> None:
    """Seed 001: the drafter's inputs are staged in one persistent host buffer, rewritten every step.

    Under asynchronous scheduling the next step's drafter inputs are written while this step's copy
    may still be pending: with copies delayed the drafter would read the next step's rows; the hazard
    checker stops the run at the rewrite, naming the buffer.
    """
    persistent = {}
    make = engine.host_buffer

    def host_buffer(name, rows, cols):
        if name != "drafter-inputs":
            return make(name, rows, cols)
        if name not in persistent:
            persistent[name] = make("drafter-inputs (persistent)", 4096, cols)
        return persistent[name]

    engine.host_buffer = host_buffer


def _host_positions(engine) -> None:
    """Own (contract 4): positions come from the host's optimistic num_computed_tokens."""
    runner = engine.runner
    host = _PlanSnapshots(engine, lambda sched: {id(r.request): r.request.num_computed_tokens for r in sched.rows})
    prepare = runner.prepare

    def prepare_from_host(plan, rows, num_computed):
        counts = num_computed.clone()
        for row, value in zip(plan.rows, host.pop(plan.index)):
            counts[row.request.idx] = value
        return prepare(plan, rows, counts)

    runner.prepare = prepare_from_host


def _prefill_in_decode_graph(engine) -> None:
    """Own (contract 6): FULL-graph eligibility judged by query lengths alone."""
    graphs = engine.graphs
    graphs.is_uniform_decode = lambda query_lens, is_decode: all(q == 1 + graphs.k for q in query_lens)


def _pad_rows_on_a_real_slot(engine) -> None:
    """Own (contract 6): a FULL step's padding rows point at request slot 0 instead of nowhere."""
    runner = engine.runner
    static_tables = runner._static_tables

    def tables_with_real_pads(n_pad):
        tables = static_tables(n_pad)
        tables.inert["target"][:, 0] = 0  # the idx column: padding rows now serve request slot 0
        return tables

    runner._static_tables = tables_with_real_pads


def _zero_draft_rows_read_drafts(engine) -> None:
    """Own (contract 5): every sampling row is verified as if it carried K drafts, zero-draft rows too."""
    runner = engine.runner
    verify = runner.verify

    def verify_all_as_k(plan, rows, step, hidden):
        full = rows.num_drafts.clone()
        full[:] = runner.k
        return verify(plan, replace(rows, num_drafts=full), step, hidden)

    runner.verify = verify_all_as_k


def _accepted_off_by_one(engine) -> None:
    """Own (contract 1): the state offset handed to the GDN kernels is one past the live state."""
    runner = engine.runner
    prepare = runner.prepare

    def prepare_off_by_one(plan, rows, num_computed):
        step = prepare(plan, rows, num_computed)
        decode = step.recurrent.decode
        if decode is not None and decode.num_accepted_tokens is not None:
            decode.num_accepted_tokens.add_(1).clamp_(max=runner.k + 1)
        return step

    runner.prepare = prepare_off_by_one


def _resume_without_reset(engine) -> None:
    """Own (contract 2): a request resumed after preemption keeps the device row of its old slot."""
    admission = engine._admission

    def admit_fresh_only(admitted):
        return admission([r for r in admitted if not r.num_preemptions])

    engine._admission = admit_fresh_only


def _preempted_keeps_placeholders(engine) -> None:
    """Own (contract 4): a preempted request keeps its optimistic placeholder tokens."""
    engine.core.scheduler.on_preempt = lambda req: None


def _stop_rule_on_optimistic_count(engine) -> None:
    """Own (contract 4): the max_tokens stop rule counts the host's optimistic placeholders."""
    core = engine.core
    stop_reason = core.stop_reason

    def stop_with_placeholders(req, token):
        reason = stop_reason(req, token)
        if reason is None and len(req.output_token_ids) + req.num_output_placeholders >= req.params.max_tokens:
            return "length"
        return reason

    core.stop_reason = stop_with_placeholders


MUTANTS: tuple[Mutant, ...] = (
    Mutant("stale-accepted-counts", "seed 000 (vLLM #45100)", "contract 3: accepted counts keyed by request",
           "GDN state offsets read from a per-row host copy of the accepted counts, stale after rows move",
           _stale_accepted, scenarios=("churn-k3", "scripted-ragged-k3")),
    Mutant("token-count-gdn-metadata", "seed 000 (vLLM #45100)", "contract 6: FULL-graph metadata sized by requests",
           "FULL-graph GDN per-request tensors padded to the token count instead of the request count",
           _token_count_metadata, graph_mode="full", scenarios=("graph-padding-k1",)),
    Mutant("short-prompt-as-decode", "seed 004 (vLLM #32716)", "contract 2: classification by context",
           "a new prompt of at most 1+K tokens is classified as a decode and skips state initialisation",
           _short_prompt_as_decode, scenarios=("short-prompts-k3", "short-prompts-mixed-k3")),
    Mutant("optimistic-backup-token", "seed 002 (vLLM #38556)", "contract 5: drafter inputs are committed tokens",
           "the drafter's next token is read at the optimistic (placeholder-inflated) sequence length",
           _optimistic_backup_token, scenarios=("mtp-k3",)),
    Mutant("shared-host-buffer", "seed 001 (async scheduling x spec decode)", "contract 7: host buffers",
           "the drafter stages its inputs in one host buffer that the next step rewrites while the copy is pending",
           _shared_host_buffer, scenarios=("chunk-tails-k3",)),
    Mutant("host-optimistic-positions", "own", "contract 4: num_computed_tokens is device-authoritative",
           "positions and slot mappings built from the host's optimistic num_computed_tokens",
           _host_positions, scenarios=("scripted-ragged-k3", "churn-k3")),
    Mutant("prefill-in-decode-graph", "own", "contract 6: no decode graph for a batch with a prefill",
           "a batch whose prefill rows happen to have 1+K tokens replays the uniform-decode FULL graph",
           _prefill_in_decode_graph, graph_mode="full", scenarios=("short-prompts-mixed-k3",)),
    Mutant("pad-rows-on-a-real-slot", "own", "contract 6: padding rows are inert",
           "a FULL step's padding rows point at request slot 0, so they write its state and tokens",
           _pad_rows_on_a_real_slot, graph_mode="full", scenarios=("mtp-k1",)),
    Mutant("zero-draft-rows-read-drafts", "own", "contract 5: drafts are what was proposed",
           "rows that carry no drafts (a finished prefill) are verified against K stale draft columns",
           _zero_draft_rows_read_drafts, scenarios=("mtp-k3", "chunk-tails-k3")),
    Mutant("accepted-count-off-by-one", "own", "contract 1: the live state is s_{a-1}",
           "the GDN kernels read the state slot one past the live one",
           _accepted_off_by_one, scenarios=("mtp-k3", "scripted-ragged-k3")),
    Mutant("resume-without-reset", "own", "contract 2: a resumed request starts from zero",
           "a request readmitted after preemption keeps its request slot's old device row",
           _resume_without_reset, scenarios=("preemption-k3", "preemption-k0")),
    Mutant("preempted-keeps-placeholders", "own", "contract 4: optimistic counts never steer recompute",
           "a preempted request keeps its optimistic placeholders and recomputes a wrong prefix",
           _preempted_keeps_placeholders, scenarios=("preemption-k3",)),
    Mutant("stop-rule-on-optimistic-count", "own", "contract 4: host copies are upper bounds only",
           "the max_tokens stop rule counts optimistic placeholders, so requests stop early",
           _stop_rule_on_optimistic_count, scenarios=("mtp-k3", "churn-k3")),
)


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
