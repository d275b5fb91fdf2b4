"""The step program reads nothing back to the host, so a GPU can run a FULL step as one graph.

Every step runs the same program (input preparation, metadata, the model, greedy verification, the
device-side commit and all K draft passes). It is run on a FULL step's static padded table, and on
an eager step that mixes prefill and decode rows, under ``FakeTensorMode``: tensors there
have shapes but no data, so any host read in the program (``.item()``, ``.tolist()``, ``bool()``
of a tensor, an op whose output shape depends on values) raises. The kernels are replaced by
shape-only stand-ins: on a GPU they are Triton launches that read nothing back, while their torch
references on CPU do read host values by design (they loop over rows).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kernels
from refengine import LLM, SamplingParams
from refengine.async_engine import runner as runner_module
from refengine.async_engine.inputs import StepRows


def _stand_ins() -> dict:
    def empty_like_arg(i):
        return lambda *a, **kw: torch.empty_like(a[i])

    def prepare_inputs(*, idx_mapping, num_tokens_padded, **kw):
        t, n = num_tokens_padded, idx_mapping.shape[0]
        i64 = {"dtype": torch.int64, "device": idx_mapping.device}
        return (torch.empty(t, **i64), torch.empty(t, **i64),
                torch.empty(n, dtype=torch.int32, device=idx_mapping.device), torch.empty(t, **i64))

    def greedy_verify(logits, drafts, num_drafts, cu, **kw):
        n, k = drafts.shape
        return (torch.empty(n, k + 1, dtype=torch.int64, device=logits.device),
                torch.empty(n, dtype=torch.int32, device=logits.device))

    return {
        "kernels": {
            "greedy_verify": greedy_verify,
            "paged_attention": empty_like_arg(0),
            "reshape_and_cache": lambda *a, **kw: None,
            "causal_conv1d_fn": empty_like_arg(0),
            "causal_conv1d_update": empty_like_arg(0),
            "fused_recurrent_gated_delta_rule": empty_like_arg(2),
            "chunk_gated_delta_rule": empty_like_arg(2),
            "linear": lambda x, w, **kw: x.new_empty(x.shape[0], w.shape[0]),
            "rms_norm": empty_like_arg(0),
            "gated_rms_norm": empty_like_arg(0),
        },
        "runner": {"prepare_inputs": prepare_inputs, "post_update": lambda **kw: None},
    }


def _captured_step(k: int, drafter: str, mode: str, want=lambda shape, rows: True, **settings):
    """An async engine after a real run, and the (shape, padded row table) of its last ``mode`` step
    that ``want`` accepts."""
    llm = LLM(engine="async", graph_mode="full", num_speculative_tokens=k, drafter=drafter,
              max_num_batched_tokens=8, **settings)
    runner, seen = llm.engine.runner, []
    enqueue = runner.enqueue

    def capture(plan):
        rows = StepRows.view(plan.inputs.tensor[: plan.shape.num_reqs])
        if plan.shape.mode.value == mode and want(plan.shape, rows):
            seen.append((plan.shape, plan.inputs.tensor[: plan.shape.num_reqs].clone()))
        return enqueue(plan)

    runner.enqueue = capture
    llm.generate(
        [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12, 13]], SamplingParams(max_tokens=8, ignore_eos=True)
    )
    assert seen, f"the workload ran no {mode} step"
    shape, table = seen[-1]
    with torch.inference_mode():  # the mode a CPU engine's steps run in (refengine.engine.Engine)
        return runner, shape, runner.graphs.pad(shape, table, runner._inert)


def _run_without_data(monkeypatch, runner, shape, table):
    stand_ins = _stand_ins()
    for name, fn in stand_ins["kernels"].items():
        monkeypatch.setattr(kernels, name, fn)
    for name, fn in stand_ins["runner"].items():
        monkeypatch.setattr(runner_module, name, fn)
    with torch.inference_mode(), FakeTensorMode(allow_non_fake_inputs=True):
        return runner.program(shape, StepRows.view(table))


@pytest.mark.parametrize("k,drafter", [(3, "mtp"), (2, "scripted"), (3, "ngram"), (0, "mtp")])
def test_full_step_program_reads_nothing_back(monkeypatch, k, drafter):
    runner, shape, table = _captured_step(k, drafter, "full")
    out = _run_without_data(monkeypatch, runner, shape, table)
    n_pad = shape.num_reqs_padded
    assert out.verified.sampled.shape == (n_pad, k + 1) and out.verified.num_valid.shape == (n_pad,)
    assert out.next_drafts.shape == (n_pad, k), "the draft passes are part of the program"
    if k and drafter == "mtp":
        assert out.drafts.chain_ids.shape == (n_pad, k - 1)


@pytest.mark.parametrize("k,drafter", [(3, "mtp"), (0, "mtp")])
def test_full_step_program_with_prefix_caching_reads_nothing_back(monkeypatch, k, drafter):
    """The checkpoint copy (the state at each boundary the kept tokens reached, masked) is part of the
    program and reads nothing back either, so a FULL step with prefix caching is still one graph."""
    runner, shape, table = _captured_step(k, drafter, "full", block_size=4, enable_prefix_caching=True,
                                          mamba_cache_mode="all")
    assert runner.num_checkpoint_columns >= 1, "the program must have checkpoint slots to fill"
    saved = []
    save = runner.caches.save_checkpoints
    runner.caches.save_checkpoints = lambda *a: saved.append(a[3].shape) or save(*a)
    out = _run_without_data(monkeypatch, runner, shape, table)
    assert out.verified.num_valid.shape == (shape.num_reqs_padded,)
    assert saved == [(shape.num_reqs_padded * runner.num_checkpoint_columns,)]


def test_an_eager_step_runs_the_same_program(monkeypatch):
    """A step with prefill chunks and decodes (not FULL) runs the same program, also without host reads."""
    def mixed(shape, rows):
        return 0 < shape.num_decode_rows < shape.num_reqs and not bool(rows.is_sampling.all())

    # decodes, and a chunk that samples nothing
    runner, shape, table = _captured_step(3, "mtp", "none", mixed)
    out = _run_without_data(monkeypatch, runner, shape, table)
    assert out.verified.sampled.shape == (shape.num_reqs, 4)


def test_a_host_read_in_the_program_is_caught(monkeypatch):
    """The check has teeth: a drafter that reads how many rows sample fails it."""
    runner, shape, table = _captured_step(3, "mtp", "full")
    propose = runner.proposer.propose

    def reads_back(d):
        if int(d.is_sampling.sum()) == 0:  # a host read of device data
            raise AssertionError("unreachable")
        return propose(d)

    runner.proposer.propose = reads_back
    with pytest.raises(Exception, match="data-dependent|DataDependent|_local_scalar_dense"):
        _run_without_data(monkeypatch, runner, shape, table)


def test_full_step_records_the_drafter_metadata_sized_by_requests():
    """Contract 6 for the drafter too: its per-request tensors in a FULL step have Np rows."""
    records = []
    llm = LLM(engine="async", graph_mode="full", num_speculative_tokens=3, observer=records.append)
    llm.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]], SamplingParams(max_tokens=8, ignore_eos=True))
    full = [r for r in records if r.graph_mode == "full"]
    assert full
    for rec in full:
        shapes, n_pad = rec.metadata_shapes, rec.num_reqs_padded
        assert shapes["drafter_chain.seq_lens"] == (n_pad,) and shapes["drafter_chain.query_start_loc"] == (
            n_pad + 1,
        )
        assert shapes["attn.seq_lens"] == (n_pad,) and shapes["drafter.query_start_loc"] == (n_pad + 1,)


def test_padding_rows_touch_nothing_a_request_can_read():
    """Padding rows of a FULL step point at the sink block (outside the KV pool) and the NULL slot, and
    a sink block full of NaN changes no output: no request ever reads what padding could write."""
    prompts, params = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]], SamplingParams(max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in LLM(num_speculative_tokens=3).generate(prompts, params)]
    llm = LLM(engine="async", graph_mode="full", num_speculative_tokens=3)
    engine, padded = llm.engine, []
    sink = engine.caches.sink_block
    assert sink == engine.config.num_kv_blocks, "the sink block is not one the KV pool hands out"
    for k_cache, v_cache in engine.caches.kv.values():
        k_cache[sink].fill_(float("nan"))
        v_cache[sink].fill_(float("nan"))
    build = engine.builder.build

    def build_and_look(shape, rows, *tables):
        attn, recurrent = build(shape, rows, *tables)
        pad = rows.idx < 0
        if bool(pad.any()):
            padded.append(shape.num_reqs_padded - shape.num_reqs)
            assert bool((attn.block_table[pad] == sink).all()), (
                "a padding row's block table names a real block"
            )
            assert bool((attn.seq_lens[pad] == 0).all())
            assert bool((recurrent.decode.state_indices[pad] == kernels.PAD_SLOT_ID).all())
        return attn, recurrent

    engine.builder.build = build_and_look
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert padded, "the workload ran no padded FULL step"
