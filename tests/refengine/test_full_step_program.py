"""A FULL step's whole program reads nothing back to the host, so a GPU can run it as one graph.

The program (input preparation, metadata, the model, greedy verification, the device-side commit
and all K draft passes) is run on its static padded tables under ``FakeTensorMode``: tensors there
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


def _captured_full_step(k: int, drafter: str):
    """An async engine after a real run, and the (plan, tables) of one of its FULL steps."""
    llm = LLM(engine="async", graph_mode="full", num_speculative_tokens=k, drafter=drafter)
    runner, seen = llm.engine.runner, []
    original = runner._uniform_program

    def capture(plan, target, fut):
        seen.append(plan)
        return original(plan, target, fut)

    runner._uniform_program = capture
    llm.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert seen, "the workload ran no FULL step"
    plan = seen[-1]
    return runner, plan, runner._static[plan.shape.num_reqs_padded].live


def _run_without_data(monkeypatch, runner, plan, tables) -> dict:
    stand_ins = _stand_ins()
    for name, fn in stand_ins["kernels"].items():
        monkeypatch.setattr(kernels, name, fn)
    for name, fn in stand_ins["runner"].items():
        monkeypatch.setattr(runner_module, name, fn)
    with FakeTensorMode(allow_non_fake_inputs=True):
        return runner._uniform_step(plan, tables)


@pytest.mark.parametrize("k,drafter", [(3, "mtp"), (2, "scripted"), (0, "mtp")])
def test_full_step_program_reads_nothing_back(monkeypatch, k, drafter):
    runner, plan, tables = _captured_full_step(k, drafter)
    out = _run_without_data(monkeypatch, runner, plan, tables)
    n_pad = plan.shape.num_reqs_padded
    assert out["sampled"].shape == (n_pad, k + 1) and out["num_valid"].shape == (n_pad,)
    assert out["next_drafts"].shape == (n_pad, k), "the draft passes are part of the program"
    if k and drafter == "mtp":
        assert out["chain_ids"].shape == (n_pad, k - 1)


def test_a_host_read_in_the_program_is_caught(monkeypatch):
    """The check has teeth: a drafter that reads how many rows are real fails it."""
    runner, plan, tables = _captured_full_step(3, "mtp")
    propose = runner.proposer.propose_uniform

    def reads_back(d):
        if int(d.real.sum()) == 0:  # a host read of device data
            raise AssertionError("unreachable")
        return propose(d)

    runner.proposer.propose_uniform = reads_back
    with pytest.raises(Exception, match="data-dependent|DataDependent|_local_scalar_dense"):
        _run_without_data(monkeypatch, runner, plan, tables)


def test_full_step_records_the_drafter_metadata_sized_by_requests():
    """Contract 6 for the drafter too: its per-request tensors in a FULL step have Np rows."""
    records = []
    llm = LLM(engine="async", graph_mode="full", num_speculative_tokens=3, observer=records.append)
    llm.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]], SamplingParams(max_tokens=8, ignore_eos=True))
    full = [r for r in records if r.graph_mode == "full"]
    assert full
    for rec in full:
        shapes, n_pad = rec.gdn_metadata_shapes, rec.num_reqs_padded
        assert shapes["drafter_chain.seq_lens"] == (n_pad,) and shapes["drafter_chain.query_start_loc"] == (n_pad + 1,)
        assert shapes["attn.seq_lens"] == (n_pad,) and shapes["drafter.query_start_loc"] == (n_pad + 1,)
