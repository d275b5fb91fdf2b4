"""The async engine equals the reference engine: tokens, acceptance, bitwise logits, over a matrix."""

from __future__ import annotations

import itertools

import pytest
import torch

from refengine import LLM, SamplingParams
from refengine.async_engine.inputs import StepRows
from refengine.async_engine.stream import HazardError, HostBuffer
from refengine.drafters import ScriptedDrafter
from tests.helpers.checkpoints import write_checkpoint

GRAPH_MODES = ["none", "piecewise", "full", "full_and_piecewise"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(write_checkpoint(tmp_path_factory.mktemp("async") / "next-tiny", "next-tiny"))


def workload(seed: int, k: int, n: int = 9):
    """Short prompts 1..K+2, longer ones, ragged max_tokens, arrivals spread over the first steps."""
    g = torch.Generator().manual_seed(seed)
    lengths = list(range(1, k + 3)) + [int(x) for x in torch.randint(5, 40, (n,), generator=g)]
    out = []
    for i, length in enumerate(lengths):
        prompt = torch.randint(0, 256, (length,), generator=g).tolist()
        max_tokens = int(torch.randint(3, 24, (1,), generator=g))
        out.append((i // 3, f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    return out


def drive(llm: LLM, items) -> dict:
    outs, step = {}, 0
    pending = sorted(items, key=lambda it: it[0])
    while pending or llm.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            llm.add_request(rid, prompt, params)
        outs.update((o.request_id, o) for o in llm.step())
        step += 1
    assert llm.engine.pools_empty(), "blocks or state slots leaked"
    return outs


def verify_outcomes(records) -> dict:
    """(verifier output, logits digest) keyed by what was verified: (request, positions, input ids).

    Keyed by content, not by step count: the engines may preempt a request at different points,
    and a re-prefill replaces a verify step, so their step sequences can differ legitimately.
    """
    return {
        (r.request_id, tuple(r.positions), tuple(r.input_ids)): (tuple(r.output_token_ids), r.logits_digest)
        for rec in records
        for r in rec.rows
        if r.logits_digest is not None
    }


def compare(ckpt, items, *, k, drafter="scripted", pattern="hash", graph_mode="none", **kw):
    def make(engine, records, truth=None, **extra):
        d = ScriptedDrafter(k, 256, pattern, truth) if (k and drafter == "scripted") else "mtp"
        return LLM(
            model=ckpt,
            engine=engine,
            num_speculative_tokens=k,
            drafter=d,
            observer=records.append,
            **kw,
            **extra,
        )

    ref_records, async_records = [], []
    ref_llm = make("reference", ref_records)
    ref = drive(ref_llm, items)
    # The async engine's drafts come from the truth the reference run computed (each request's greedy
    # output on the same weights: a function of the request alone), not from a second truth engine.
    truth = ref_llm.config.speculative.drafter.truth if (k and drafter == "scripted") else None
    llm = make("async", async_records, truth, graph_mode=graph_mode)
    got = drive(llm, items)
    for rid, o in ref.items():
        assert got[rid].token_ids == o.token_ids, (
            f"{rid}: async {got[rid].token_ids} != reference {o.token_ids}"
        )
        if o.num_preemptions == got[rid].num_preemptions == 0:
            assert got[rid].acceptance == o.acceptance, f"{rid}: acceptance differs"
    ours, theirs = verify_outcomes(async_records), verify_outcomes(ref_records)
    shared = ours.keys() & theirs.keys()
    assert len(shared) >= 0.5 * len(theirs), "too few verify steps in common to compare"
    assert {key: ours[key] for key in shared} == {key: theirs[key] for key in shared}, \
        "the same verify step (same positions and inputs) gave different outputs or logits"
    check_records(async_records, k)
    return llm, async_records


def check_records(records, k):
    for rec in records:
        for r in rec.rows:
            for t in r.input_ids + r.drafter_input_ids + r.draft_token_ids + r.next_draft_token_ids:
                assert 0 <= t < 256, f"id {t} reached the model or drafter ({r.request_id})"
            if r.num_computed_tokens == 0:
                assert r.kind == "prefill" and not r.has_initial_state and r.state_slot_read is None
        if rec.graph_mode == "full":
            n = rec.num_reqs_padded
            assert rec.metadata_shapes["decode.state_indices"][0] == n
            assert rec.metadata_shapes["decode.query_start_loc"] == (n + 1,)
            if k:
                assert rec.metadata_shapes["decode.num_valid"] == (n,)


# The corpus runs churn-k1/k3 in the default graph mode (full_and_piecewise) on every default-tier run.
@pytest.mark.parametrize("graph_mode", ["none", *(
    pytest.param(m, marks=pytest.mark.slow) for m in ("full_and_piecewise", "piecewise", "full"))])
def test_churn_scripted(ckpt, graph_mode):
    llm, records = compare(ckpt, workload(1, 3), k=3, graph_mode=graph_mode, max_num_seqs=5,
                           max_num_batched_tokens=24)
    assert llm.engine.stats.row_moves > 0, "rows never moved: the persistent batch was not exercised"
    if graph_mode in ("full", "full_and_piecewise"):
        assert any(r.graph_mode == "full" and r.num_reqs_padded > len(r.rows) for r in records), (
            "no padded replay"
        )


@pytest.mark.parametrize("k", [0, pytest.param(1, marks=pytest.mark.slow)])  # K=1: the corpus's *-k1
def test_small_k(ckpt, k):
    compare(
        ckpt, workload(2, k), k=k, graph_mode="full_and_piecewise", max_num_seqs=4, max_num_batched_tokens=16
    )


def test_mtp_drafts(ckpt):
    compare(ckpt, workload(3, 3, n=5), k=3, drafter="mtp", graph_mode="full", max_num_seqs=4)


@pytest.mark.parametrize("pattern", [pytest.param("all-accept", marks=pytest.mark.slow), "all-reject"])
def test_scripted_extremes(ckpt, pattern):
    compare(ckpt, workload(4, 3, n=4), k=3, pattern=pattern, max_num_seqs=4)


@pytest.mark.slow  # the corpus's preemption-k0/k3 and recycled-slots-k0/k3 on every default-tier run
def test_preemption_and_dirty_slots(ckpt):
    items = workload(5, 2, n=8)
    compare(ckpt, items, k=2, block_size=4, num_kv_blocks=40, max_model_len=80, max_num_seqs=6)


@pytest.mark.parametrize("delay,hazard", [(True, True), *(
    pytest.param(d, h, marks=pytest.mark.slow) for d, h in ((True, False), (False, True)))])
def test_delay_and_hazard_modes_stay_exact(ckpt, delay, hazard):
    items = workload(6, 3, n=5)
    ref = drive(LLM(model=ckpt, num_speculative_tokens=3, drafter="scripted"), items)
    llm = LLM(model=ckpt, engine="async", num_speculative_tokens=3, drafter="scripted",
              graph_mode="full_and_piecewise", delay_copies=delay, hazard_check=hazard)
    got = drive(llm, items)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}
    assert llm.engine.stream.num_host_waits <= llm.engine.stats.steps + 1, "more than one sync per step"
    waited = llm.engine.stream.host_wait_seconds
    elapsed = llm.engine.stats.elapsed
    assert 0 < waited <= elapsed, f"host wait {waited} s outside (0, {elapsed}] s"


def test_hazard_checker_names_the_buffer(ckpt):
    """A host buffer rewritten while its copy is pending raises, naming the buffer."""
    llm = LLM(model=ckpt, engine="async", delay_copies=True, hazard_check=True)
    runner, shared = llm.engine.runner, {}
    enqueue = runner.enqueue

    def from_one_buffer(plan):
        buf = shared.setdefault(
            "buf", HostBuffer("shared-step-inputs", llm.engine.stream, (64, StepRows.width()), torch.int64)
        )
        buf.write(plan.inputs.tensor[: plan.shape.num_reqs])
        plan.inputs = buf
        return enqueue(plan)

    runner.enqueue = from_one_buffer
    llm.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(HazardError, match="shared-step-inputs"):
        while llm.has_unfinished():
            llm.step()


@pytest.mark.slow
@pytest.mark.parametrize("k,graph_mode,seed", list(itertools.product([0, 1, 3], GRAPH_MODES, [11, 12])))
def test_matrix(ckpt, k, graph_mode, seed):
    compare(ckpt, workload(seed, k), k=k, graph_mode=graph_mode, max_num_seqs=3 + seed % 3,
            max_num_batched_tokens=8 + 4 * k)


@pytest.mark.parametrize("engine", ["reference", "async"])
def test_records_report_preemptions_resumptions_and_the_kernels_initial_state_flags(engine):
    """Step records carry what happened: preemptions and resumptions, and the has_initial_state the
    GDN kernels were handed (a resumed request's first chunk starts from zero state again)."""
    records = []
    kw = {"graph_mode": "full_and_piecewise", "delay_copies": True} if engine == "async" else {}
    llm = LLM(engine=engine, num_speculative_tokens=2, block_size=4, num_kv_blocks=24, max_model_len=60,
              max_num_seqs=6, observer=records.append, **kw)
    prompts = [[(7 * i + j) % 250 for j in range(5 + 3 * i)] for i in range(6)]
    llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    preempted = [rid for r in records for rid in r.preempted]
    resumed = [rid for r in records for rid in r.resumed]
    assert preempted, "the tiny KV pool should force preemption"
    assert resumed and set(resumed) <= set(preempted), (preempted, resumed)
    first_chunks = 0
    for rec in records:
        for row in rec.rows:
            if row.kind == "prefill":
                assert row.has_initial_state == (row.num_computed_tokens > 0), row
                first_chunks += row.num_computed_tokens == 0
    assert first_chunks >= len(prompts) + len(set(resumed)), "resumed requests restart from zero state"


def test_sampling_and_partial_prefill_rows_interleave_in_every_order():
    """Steps that mix rows which sample (decodes, last prompt chunks) with prompt chunks that do not, the
    non-sampling rows before and after sampling ones in batch order, are exact (K=3, a 12-token budget)."""
    g = torch.Generator().manual_seed(5)  # a workload found to give both orders
    params, drawn = SamplingParams(max_tokens=5, ignore_eos=True), []
    for i in range(int(torch.randint(3, 7, (1,), generator=g))):
        length, arrival = (
            int(torch.randint(1, 26, (1,), generator=g)),
            int(torch.randint(0, 4, (1,), generator=g)),
        )
        drawn.append((arrival, f"r{i}", torch.randint(0, 256, (length,), generator=g).tolist()))
    items = [(*item, params) for item in sorted(drawn)]
    settings = {"num_speculative_tokens": 3, "max_num_batched_tokens": 12}  # the embedded default model
    ref_records, records = [], []
    ref = drive(LLM(observer=ref_records.append, **settings), items)
    got = drive(LLM(engine="async", observer=records.append, **settings), items)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}

    def drafts(recs):  # (request, first position) -> the drafts verified there
        return {(row.request_id, row.num_computed_tokens): row.draft_token_ids
                for rec in recs for row in rec.rows if row.kind == "decode"}

    assert drafts(records) == drafts(ref_records), "a sampling row's drafter read another row's input"
    orders = set()
    for rec in records:
        kinds = "".join("S" if row.output_token_ids is not None else "P" for row in rec.rows)
        if "S" in kinds and "P" in kinds:
            orders |= {"PS"} if kinds.index("P") < kinds.rindex("S") else set()
            orders |= {"SP"} if kinds.index("S") < kinds.rindex("P") else set()
    assert orders == {"PS", "SP"}, f"row orders seen: {orders}"


def test_debug_mode_refuses_a_drafter_input_outside_the_vocabulary(ckpt):
    """With hazard_check, an id outside the vocabulary fed to the MTP head is refused, naming the request
    slot, once the step is done: the ids are checked on the host copies the step leaves (a read inside the
    step program would sync in a captured graph, and a check after it would wait for the step); the head
    reads them clamped."""
    from refengine.drafters import DrafterInputError

    llm = LLM(model=ckpt, engine="async", num_speculative_tokens=2, hazard_check=True)
    proposer = llm.engine.runner.proposer
    next_token_ids = proposer.next_token_ids
    proposer.next_token_ids = lambda d: next_token_ids(d) + llm.engine.core.model_config.vocab_size
    llm.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(DrafterInputError, match=r"input id \d+ \(outside \[0, \d+\)\) for request slot 0"):
        while llm.has_unfinished():
            llm.step()
