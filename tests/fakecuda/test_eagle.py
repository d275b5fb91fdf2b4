"""The async engine's step program with an EAGLE-3 drafter on fake CUDA: the head loaded onto the target's
device, the auxiliary hidden states captured inside the program, the first pass and the chained passes,
with no host read, no CPU tensor and no device mismatch. The default tier replays a FULL decode step and a
mixed step; ``-m slow`` every kind of step (prefix-cache restores and checkpoints too), EAGLE-1 and every
graph mode."""

from __future__ import annotations

import pytest

from refengine.config import GraphMode
from refengine.llm import default_model_path
from refengine.model.eagle import loader
from refengine.tools.eagle_head import add_eagle_head
from tests.helpers.fake_cuda import FakeCuda
from tests.helpers.fake_engines import SETTINGS, WAVES, AsyncTwin, covering, record_async, step_kinds

CASES = [(m, mode) for m in ("eagle3", "eagle") for mode in (g.value for g in GraphMode)]
DEFAULT = ("eagle3", "full_and_piecewise")


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake-cuda-eagle")
    add_eagle_head(default_model_path(), root / "eagle", "eagle", seed=1)
    add_eagle_head(default_model_path(), root / "eagle3", "eagle3", draft_vocab_size=200, seed=2)
    return {"eagle": str(root / "eagle"), "eagle3": str(root / "eagle3")}


@pytest.mark.parametrize("method,mode", [
    pytest.param(*c, id="-".join(c), marks=[] if c == DEFAULT else [pytest.mark.slow]) for c in CASES])
def test_eagle_steps_on_fake_cuda(method, mode, heads, monkeypatch):
    run = record_async(WAVES[:2], max_tokens=6, graph_mode=mode, num_speculative_tokens=3, drafter=method,
                       draft_model=heads[method], **SETTINGS)
    steps, kinds = covering(run.snaps, 3, method)
    want = {"prefill", "mixed", f"verify {method}", "restore", "checkpoint"}
    if GraphMode(mode).has_full:
        want.add("full decode")
    assert kinds >= want, f"the workload lacks {want - kinds}"
    fc = FakeCuda()
    # The twin's engine loads the head inside fake mode, where no file can be read: it gets the head's
    # tensors read here, as fake host tensors.
    on_disk = loader.read_head_tensors(heads[method])
    monkeypatch.setattr(loader, "read_head_tensors", lambda path: fc.host(on_disk))
    monkeypatch.setattr(loader, "check_d2t", lambda *a: None)  # values checked by the real load above
    twin = AsyncTwin(fc, run.llm.engine)
    head = twin.runner.proposer.head
    assert next(head.parameters()).is_cuda, "the head is loaded onto the target's device"
    assert twin.runner.aux_layers == ((1, 2, 3) if method == "eagle3" else ())
    if (method, mode) == DEFAULT:  # the default tier: the drafter's two forms, a FULL and a mixed step
        full = [snap for snap in steps if snap.shape.mode is GraphMode.FULL][:1]
        steps = full + [snap for snap in steps if "mixed" in step_kinds(snap, 3, method)][:1]
    for snap in steps:
        out = twin.step(snap)
        if snap.shape.mode is GraphMode.FULL and method == "eagle3":
            assert out.step.aux_hidden is not None and out.step.aux_hidden.is_cuda
    launched = set(fc.launches.kernels())
    assert {"paged_attention_kernel", "reshape_and_cache_kernel", "linear_kernel"} <= launched
