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

The seam is ``AsyncRunner.stage`` + ``AsyncRunner.program``, driven with the row tables a real run
staged: the engine's ``step()`` around them is host logic (scheduling, and the one read-back of each
step's kept tokens, by design) and graph capture itself needs a GPU. For the reference engine it is
``ReferenceRunner.execute``, whose single designed read-back (the verifier's tokens) is answered with
placeholders.

Default tier: the default model, one async configuration that has every kind of step, the reference
engine, and planted bugs. ``-m slow``: every graph mode, K and drafter (MTP, n-gram, scripted), bfloat16
and the chunked GDN prefill, over every family in ``FAMILY_CHECKPOINTS``.
"""

from __future__ import annotations

import pytest
import torch

from refengine.config import GraphMode
from tests.helpers.fake_cuda import FakeCuda
from tests.helpers.fake_engines import (
    DENSE_FAMILIES,
    FAMILY_CHECKPOINTS,
    GRAMMAR_PARAMS,
    REQUEST_PARAMS,
    RESTORES,
    SETTINGS,
    WAVES,
    AsyncTwin,
    checkpoint_path,
    covering,
    record_async,
    record_reference,
)

ALWAYS = {"prefill", "prefill chunk", "mixed", "admission", "preempted", "resumed"}
CACHING = {"restore", "checkpoint"}
MODES = [m.value for m in GraphMode]
# Beyond the settings of SETTINGS: the chunked GDN prefill (it excludes prefix caching) and bfloat16.
VARIANTS = {"": {}, "chunked": {"recurrent_prefill_chunked": True, "enable_prefix_caching": False,
                              "mamba_cache_mode": None},
            "bf16": {"dtype": "bfloat16"}}
DEFAULT = ("qwen3-next-default", "full_and_piecewise", 3, "mtp", "")


def head_drafter(family: str) -> str:
    """The family's own drafts: MTP, or scripted drafts where its checkpoint has no MTP head."""
    return "scripted" if family in DENSE_FAMILIES else "mtp"


def family_variants(family: str) -> tuple[str, ...]:
    return ("bf16",) if family in DENSE_FAMILIES else ("chunked", "bf16")  # chunked: the GDN prefill


CASES = [(family, mode, k, drafter, "") for family in FAMILY_CHECKPOINTS for mode in MODES
         for k, drafter in ((0, "mtp"), (3, head_drafter(family)), (3, "ngram"))]
CASES += [(family, "full_and_piecewise", 3, head_drafter(family), variant) for family in FAMILY_CHECKPOINTS
          for variant in family_variants(family)]
# The conformance suite's scripted drafter, whose proposer has device tables of its own.
CASES += [("qwen3-next-default", mode, 2, "scripted", "") for mode in MODES]


def case_id(case) -> str:
    family, mode, k, drafter, variant = case
    return "-".join(filter(None, (family, mode, f"k{k}", drafter, variant)))


def expected_kinds(mode: str, k: int, drafter: str, variant: str, dense: bool = False) -> set[str]:
    kinds = set(ALWAYS) | {"processors", "logprobs", "sampling"}
    if {**SETTINGS, **VARIANTS[variant]}["enable_prefix_caching"]:
        kinds |= CACHING - {"checkpoint"} if dense else CACHING  # no recurrent state to checkpoint
    if GraphMode(mode).has_full:
        kinds |= {"full decode", "full processors", "full sampling"}
    if k:
        kinds.add(f"verify {drafter}")
    return kinds


def record(family, mode, k, drafter, variant, tmp_path_factory):
    model = checkpoint_path(FAMILY_CHECKPOINTS[family], tmp_path_factory)
    return record_async(WAVES, max_tokens=10, model=model, graph_mode=mode, num_speculative_tokens=k,
                        drafter=drafter, request_params=REQUEST_PARAMS, **{**SETTINGS, **VARIANTS[variant]})


@pytest.mark.parametrize("family,mode,k,drafter,variant", [
    pytest.param(*case, id=case_id(case), marks=[] if case == DEFAULT else [pytest.mark.slow])
    for case in CASES])
def test_async_steps_on_fake_cuda(family, mode, k, drafter, variant, tmp_path_factory, request):
    if (family, mode, k, drafter, variant) == DEFAULT:
        run = request.getfixturevalue("default_run")
    else:
        run = record(family, mode, k, drafter, variant, tmp_path_factory)
    steps, kinds = covering(run.snaps, k, drafter)
    dense = family in DENSE_FAMILIES
    want = expected_kinds(mode, k, drafter, variant, dense)
    if (family, mode, k, drafter, variant) == DEFAULT:  # structured outputs: the default model's tokenizer
        want |= {"grammar", "full grammar"}
    assert kinds >= want, f"the workload lacks {want - kinds}"
    if drafter == "ngram" and FAMILY_CHECKPOINTS[family] is None:  # random weights rarely repeat a 5-gram
        counts = run.draft_counts()
        assert 0 in counts and max(counts) > 0, f"n-gram steps should verify 0..K drafts, saw {counts}"
    fc = FakeCuda()
    twin = AsyncTwin(fc, run.llm.engine)
    for snap in steps:
        twin.step(snap)
    launched = set(fc.launches.kernels())
    want = {"prepare_inputs_kernel", "post_update_kernel", "paged_attention_kernel", "greedy_verify_kernel",
            "reshape_and_cache_kernel", "linear_kernel", "rms_norm_kernel"}
    if not dense:
        want |= {"fused_recurrent_gated_delta_rule_fwd_kernel", "causal_conv1d_fwd_kernel",
                 "gated_rms_norm_kernel"}
    if variant == "chunked":
        want |= {"chunk_gdn_wy_kernel", "chunk_gdn_state_kernel", "chunk_gdn_output_kernel"}
    if FAMILY_CHECKPOINTS[family] is not None and "moe" in FAMILY_CHECKPOINTS[family]:
        want |= {"moe_gate_up_kernel", "moe_down_kernel", "moe_combine_kernel"}
    assert want <= launched, f"not launched: {want - launched}"


def _host_index(d, state):
    rows = torch.arange(d.idx.shape[0])  # on the CPU: torch accepts a CPU index into a CUDA tensor
    return state.num_drafts[d.idx[rows]]


def _host_read(d, state):
    return int(d.is_sampling.sum())  # a device-to-host read


def _device_mix(d, state):
    return d.kept + torch.ones(d.kept.shape[0], dtype=torch.int64)  # a CPU operand of a CUDA op


@pytest.mark.parametrize("plant,expected", [
    (_host_index, "the step program created tensors on the CPU.*arange"),
    (_host_read, "data-dependent|DataDependent|_local_scalar_dense"),
    (_device_mix, "Expected all tensors to be on the same device|found two different devices"),
], ids=["host index", "host read", "device mix"])
def test_planted_device_bugs_in_the_step_program_are_caught(default_run, plant, expected):
    """Planted bugs in the drafter's step (part of the program): an index built without ``device=``, a
    host read of a device value, a CPU operand mixed into device math."""
    fc = FakeCuda()
    twin = AsyncTwin(fc, default_run.llm.engine)
    proposer = twin.runner.proposer
    propose = proposer.propose

    def planted(d):
        plant(d, twin.runner.state)
        return propose(d)

    proposer.propose = planted
    decode = next(s for s in default_run.snaps if s.shape.mode is GraphMode.FULL)
    with pytest.raises(Exception, match=expected):  # unplanted, the same step passes (the test above)
        twin.step(decode)


def _stage_host_copy(src, slot0):
    return src.cpu(), slot0  # the restore index brought back to the host: a CPU tensor in staging


def _stage_host_read(src, slot0):
    int(src.max())  # a device-to-host read in staging
    return src, slot0


@pytest.mark.parametrize("plant,expected", [
    (_stage_host_copy, "staging created tensors on the CPU.*_to_copy"),
    (_stage_host_read, "data-dependent|DataDependent|_local_scalar_dense"),
], ids=["host copy", "host read"])
def test_planted_device_bugs_in_staging_are_caught(default_run, plant, expected):
    """Planted bugs in the restores ``runner.stage`` applies from the staged writes' one device copy: a
    restore index copied to the host, a host read of it."""
    fc = FakeCuda()
    twin = AsyncTwin(fc, default_run.llm.engine)
    caches = twin.runner.caches
    restore = caches.restore_checkpoints
    caches.restore_checkpoints = lambda src, slot0: restore(*plant(src, slot0))
    hit = next(s for s in default_run.snaps if s.writes.get(RESTORES) is not None)
    with pytest.raises(Exception, match=expected):  # unplanted, the same step passes (a covered restore)
        twin.step(hit)


@pytest.mark.parametrize("family,variant", [
    pytest.param(f, v, id="-".join(filter(None, (f, v))),
                 marks=[] if (i, v) == (0, "") else [pytest.mark.slow])
    for i, f in enumerate(FAMILY_CHECKPOINTS) for v in (("",) if f in DENSE_FAMILIES else ("", "chunked"))])
def test_reference_steps_on_fake_cuda(family, variant, tmp_path_factory):
    fc = FakeCuda()
    dense = family in DENSE_FAMILIES
    _, results = record_reference(WAVES, fc, max_tokens=10,
                                  model=checkpoint_path(FAMILY_CHECKPOINTS[family], tmp_path_factory),
                                  num_speculative_tokens=3, drafter=head_drafter(family),
                                  **{**SETTINGS, **VARIANTS[variant]})
    steps = [r for r in results if not isinstance(r, str)]
    assert len(steps) >= 3, "prefill, decode and mixed steps"
    assert all(r.hidden.is_cuda for r in steps)
    if not variant and not dense:  # a dense model has no recurrent state to checkpoint
        assert {"restore_checkpoint", "save_checkpoint"} <= {r for r in results if isinstance(r, str)}
    launched = set(fc.launches.kernels())
    want = {"paged_attention_kernel", "greedy_verify_kernel", "reshape_and_cache_kernel", "linear_kernel"}
    if not dense:
        want |= {"fused_recurrent_gated_delta_rule_fwd_kernel", "causal_conv1d_fwd_kernel"}
    if variant == "chunked":
        want |= {"chunk_gdn_wy_kernel", "chunk_gdn_state_kernel", "chunk_gdn_output_kernel"}
    assert want <= launched, f"not launched: {want - launched}"


@pytest.mark.slow
def test_structured_outputs_steps_on_fake_cuda_eager():
    """Steps with grammar rows, run in two parts (the forward, the host's bitmask copied into its static
    buffer, then the rest) in an eager run (the default run above has them eager and FULL)."""
    run = record_async(WAVES[1:2], max_tokens=6, graph_mode="none", num_speculative_tokens=3,
                       grammar_params=GRAMMAR_PARAMS, **SETTINGS)
    steps, kinds = covering(run.snaps, 3, "mtp")
    assert kinds >= {"grammar", "prefill", "admission"}, kinds
    assert any(not s.shape.grammar for s in run.snaps), "steps without grammar rows too"
    fc = FakeCuda()
    twin = AsyncTwin(fc, run.llm.engine)
    for snap in steps:
        twin.step(snap)
