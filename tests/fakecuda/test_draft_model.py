"""The draft-model drafter's device proposer on fake CUDA: its first pass (the target's step metadata, its
own caches), the copy of the live recurrent state into a scratch slot and the chained passes are part of
the async engine's step program, so every kind of step a CPU run recorded must replay on fake CUDA with no
device mismatch, no host read and no tensor created on the CPU. The draft model is the embedded default
model cut to layers 0 and 3 (a GDN layer and an attention layer: both kinds of draft cache)."""

from __future__ import annotations

import pytest

from refengine.config import GraphMode
from refengine.drafters.draft_model import DraftModelDrafter
from refengine.llm import default_model_path
from refengine.tools.draft_model import cut_draft_model
from tests.helpers.fake_cuda import FakeCuda
from tests.helpers.fake_engines import SETTINGS, WAVES, AsyncTwin, covering, record_async

KINDS = {"prefill", "prefill chunk", "mixed", "admission", "restore", "checkpoint", "verify draft_model"}
DEFAULT = GraphMode.FULL_AND_PIECEWISE.value


@pytest.mark.parametrize("mode", [pytest.param(m.value, marks=[] if m.value == DEFAULT else
                                               [pytest.mark.slow]) for m in GraphMode])
def test_draft_model_steps_on_fake_cuda(mode):
    """Default tier: the first two waves (a prefix hit, mixed steps, FULL verify steps); ``-m slow``: every
    graph mode over every wave (preemption and resumption too)."""
    draft = cut_draft_model(default_model_path(), "0,3")
    waves = WAVES[:2] if mode == DEFAULT else WAVES
    run = record_async(waves, max_tokens=6 if mode == DEFAULT else 8, graph_mode=mode,
                       num_speculative_tokens=3, drafter="draft_model", draft_model=draft, **SETTINGS)
    steps, kinds = covering(run.snaps, 3, "draft_model")
    want = KINDS | ({"full decode"} if GraphMode(mode).has_full else set())
    want |= set() if mode == DEFAULT else {"preempted", "resumed"}
    assert kinds >= want, f"the workload lacks {want - kinds}"
    fc = FakeCuda()
    engine = run.llm.engine
    # The twin's engine takes the draft model as the target's: a fake CUDA copy (a drafter that holds its
    # model is not loaded again: a checkpoint cannot be read into fake tensors).
    cpu = engine.drafter
    with fc:
        model = fc.module(cpu.model)
    engine.config.speculative.drafter = DraftModelDrafter(3, cpu.path, cpu.vocab_size, model=model,
                                                          config=cpu.config)
    twin = AsyncTwin(fc, engine)
    assert twin.runner.proposer.drafter.model is model
    for snap in steps:
        twin.step(snap)
    launched = set(fc.launches.kernels())
    assert {"fused_recurrent_gated_delta_rule_fwd_kernel", "paged_attention_kernel"} <= launched
