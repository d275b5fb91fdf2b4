"""Both engines, one step of every kind, on fake CUDA (see tests/helpers/fake_engines.py for the twins).

The async engine's device side (persistent state, caches, drafter tables, the model's weights) is built
on fake CUDA by its own constructor; every kind of step a real CPU run recorded is replayed through the
twin's ``runner.stage`` and ``runner.program`` (the device step program: input preparation, metadata,
the model, verification, the commit, the prefix-cache checkpoint copies and the draft passes): a
prefill chunk, a mixed prefill + decode step, a FULL decode step, a verify step with MTP or n-gram
drafts, a prefix-cache restore and checkpoint copies, a preempted and a resumed request, in every graph
mode and K 0 / 3. Each must run with no device mismatch, no host read, no tensor created on the CPU
and every Triton launch as its kernel assumes (``kernels._launch_check``). The reference engine's
twin repeats every step's ``runner.execute`` (the inputs built on the device, the model forward, the
logits and the verification launch) and its prefix-cache copies.

Default tier: the default model, one async configuration that has every kind of step, and the
reference engine. ``-m slow``: every graph mode, K and drafter, over every family in
``FAMILY_CHECKPOINTS``.
"""

from __future__ import annotations

import pytest
import torch

from refengine.config import GraphMode
from tests.helpers.fake_cuda import FakeCuda
from tests.helpers.fake_engines import (
    FAMILY_CHECKPOINTS,
    SETTINGS,
    WAVES,
    AsyncTwin,
    checkpoint_path,
    covering,
    record_async,
    record_reference,
)

ALWAYS = {"prefill", "prefill chunk", "mixed", "admission", "restore", "checkpoint", "preempted", "resumed"}
MODES = [m.value for m in GraphMode]
MATRIX = [pytest.param(family, mode, k, drafter, marks=pytest.mark.slow, id=f"{family}-{mode}-k{k}-{drafter}")
          for family in FAMILY_CHECKPOINTS for mode in MODES
          for k, drafter in ((0, "mtp"), (3, "mtp"), (3, "ngram"))
          if (family, mode, k, drafter) != ("qwen3-next-default", "full_and_piecewise", 3, "mtp")]
DEFAULT = pytest.param("qwen3-next-default", "full_and_piecewise", 3, "mtp",
                       id="qwen3-next-default-full_and_piecewise-k3-mtp")


def expected_kinds(mode: str, k: int, drafter: str) -> set[str]:
    kinds = set(ALWAYS)
    if GraphMode(mode).has_full:
        kinds.add("full decode")
    if k:
        kinds.add(f"verify {drafter}")
    return kinds


@pytest.mark.parametrize("family,mode,k,drafter", [DEFAULT, *MATRIX])
def test_async_steps_on_fake_cuda(family, mode, k, drafter, tmp_path_factory):
    model = checkpoint_path(FAMILY_CHECKPOINTS[family], tmp_path_factory)
    run = record_async(WAVES, max_tokens=10, model=model, graph_mode=mode, num_speculative_tokens=k,
                       drafter=drafter, **SETTINGS)
    steps, kinds = covering(run.snaps, k, drafter)
    want = expected_kinds(mode, k, drafter)
    assert kinds >= want, f"the workload lacks {want - kinds}"
    fc = FakeCuda()
    twin = AsyncTwin(fc, run.llm.engine)
    for snap in steps:
        twin.step(snap)
    launched = set(fc.launches.kernels())
    assert {"prepare_inputs_kernel", "post_update_kernel", "paged_attention_kernel", "greedy_verify_kernel",
            "fused_recurrent_gated_delta_rule_fwd_kernel", "causal_conv1d_fwd_kernel"} <= launched, launched


def test_a_host_tensor_in_the_step_program_is_caught():
    """A planted bug: the drafter indexes device state with an index built without ``device=`` (torch
    accepts a CPU index into a CUDA tensor, so only the watch on CPU tensors sees it)."""
    run = record_async(WAVES[:1], max_tokens=4, graph_mode="full", num_speculative_tokens=3, **SETTINGS)
    fc = FakeCuda()
    twin = AsyncTwin(fc, run.llm.engine)
    proposer = twin.runner.proposer
    propose = proposer.propose

    def host_index(d):
        rows = torch.arange(d.idx.shape[0])  # on the CPU
        twin.runner.state.num_drafts[d.idx[rows]]
        return propose(d)

    proposer.propose = host_index
    decode = next(s for s in run.snaps if s.shape.mode is GraphMode.FULL)
    with pytest.raises(AssertionError, match="the step program created tensors on the CPU.*arange"):
        twin.step(decode)


@pytest.mark.parametrize("family", [pytest.param(f, marks=[pytest.mark.slow] if i else [])
                                    for i, f in enumerate(FAMILY_CHECKPOINTS)])
def test_reference_steps_on_fake_cuda(family, tmp_path_factory):
    fc = FakeCuda()
    _, results = record_reference(WAVES, fc, max_tokens=10,
                                  model=checkpoint_path(FAMILY_CHECKPOINTS[family], tmp_path_factory),
                                  num_speculative_tokens=3, **SETTINGS)
    steps = [r for r in results if not isinstance(r, str)]
    assert steps and {"restore_checkpoint", "save_checkpoint"} <= {r for r in results if isinstance(r, str)}
    assert all(r.hidden.is_cuda for r in steps)
    assert {"paged_attention_kernel", "greedy_verify_kernel", "chunk_gdn_output_kernel"} & set(
        fc.launches.kernels())
