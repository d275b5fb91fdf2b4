"""Piecewise steps' pieces (``refengine.model.pieces``) replayed from their first capture, on CPU.

``PieceGraphs(emulate=True)`` keeps what a CUDA graph keeps: the piece as first captured, its input buffers
and its output tensors; a replay reruns that first piece over the buffers into the outputs. A piece that read
a tensor of the step from anywhere but its inputs (a closure, a module attribute set per step), wrote
anything but its outputs, or a forward whose pieces' data flow changed between steps, gives the wrong tokens
here, as it would on a GPU. Every step of these runs is piecewise (``graph_mode="piecewise"``).
"""

from __future__ import annotations

import pytest
import torch

from refengine import LLM, SamplingParams
from refengine.async_engine.graphs import PieceGraphs
from refengine.llm import default_model_path
from refengine.tools.eagle_head import add_eagle_head
from refengine.tools.tiny_models import tiny_model_path
from tests.helpers import llama_checkpoints, nemotron_checkpoints
from tests.refengine.test_async_engine import drive, verify_outcomes, workload

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pieces")
    add_eagle_head(default_model_path(), root / "eagle3", "eagle3", draft_vocab_size=180, seed=4)
    return {
        "default": str(default_model_path()),
        "eagle3": str(root / "eagle3"),
        "nemotron-mtp": tiny_model_path("tiny:nemotron_h"),  # Mamba2, attention, MoE blocks; an MTP head
        "nemotron-moe": str(nemotron_checkpoints.write_checkpoint(root / "nemotron", "nemotron-moe")),
        "dense": str(llama_checkpoints.write_checkpoint(root / "dense", "qwen3")),
    }


def run_both(model: str, k: int, drafter: str | None, **kw):
    items = workload(7, k, n=6)
    kw = dict(model=model, num_speculative_tokens=k, max_num_seqs=6, max_num_batched_tokens=48, **kw)
    if drafter:
        kw["drafter"] = drafter
    ref_records, records = [], []
    ref = drive(LLM(engine="reference", observer=ref_records.append, **kw), items)
    llm = LLM(engine="async", graph_mode="piecewise", observer=records.append, **kw)
    llm.engine.runner.pieces = pieces = PieceGraphs(CPU, emulate=True)
    got = drive(llm, items)
    return ref, got, ref_records, records, pieces


CASES = [("default", 3, "mtp"), ("eagle3", 3, "eagle3"), ("nemotron-mtp", 3, "mtp"),
         ("nemotron-moe", 0, None), ("dense", 0, None)]


@pytest.mark.parametrize("name,k,drafter", CASES, ids=[c[0] for c in CASES])
def test_replayed_pieces_give_the_reference_engines_tokens_and_logits(models, name, k, drafter):
    extra = {"draft_model": models[name]} if drafter == "eagle3" else {}
    model = models["default" if extra else name]
    ref, got, ref_records, records, pieces = run_both(model, k, drafter, **extra)
    for rid, o in ref.items():
        assert got[rid].token_ids == o.token_ids, f"{rid}: {got[rid].token_ids} != reference {o.token_ids}"
        assert got[rid].acceptance == o.acceptance, f"{rid}: acceptance differs"
    ours, theirs = verify_outcomes(records), verify_outcomes(ref_records)
    shared = ours.keys() & theirs.keys()
    assert len(shared) >= 0.5 * len(theirs)
    assert {key: ours[key] for key in shared} == {key: theirs[key] for key in shared}
    assert len(pieces.token_counts()) > 1, "pieces captured at one padded size only"
    assert pieces.replays > len(pieces), "no piece was replayed after its capture"


def test_a_replay_reads_the_first_capture_and_a_changed_flow_is_refused():
    g = PieceGraphs(CPU, emulate=True)
    step1 = torch.ones(4)
    (a,) = g("p", lambda x: (x + step1,), torch.zeros(4))
    assert a.tolist() == [1.0] * 4
    step2 = torch.full((4,), 5.0)  # a second step's closure: a replay never sees it
    (b,) = g("p", lambda x: (x + step2,), torch.full((4,), 2.0))
    assert b is a and b.tolist() == [3.0] * 4
    (c,) = g("q", lambda y: (y * 2,), a)  # a's output read in place
    assert c.tolist() == [6.0] * 4
    with pytest.raises(RuntimeError, match="data flow changed"):
        g("q", lambda y: (y * 2,), torch.zeros(4))


def test_only_piecewise_steps_within_the_size_limit_replay_pieces(models):
    llm = LLM(model=models["default"], engine="async", graph_mode="full_and_piecewise", max_num_seqs=4,
              max_num_batched_tokens=24)  # a 40-token prompt: a 24-token chunk, then 16
    runner = llm.engine.runner
    assert not runner.pieces.live(8), "CPU engines run their pieces eagerly"
    runner.pieces = PieceGraphs(CPU, emulate=True, max_tokens=16)
    assert runner.pieces.live(16) and not runner.pieces.live(24)
    drive(llm, [(0, "a", list(range(40)), SamplingParams(max_tokens=4, ignore_eos=True))])
    assert runner.pieces.token_counts() == {16}, \
        "the 16-token chunk only (24 is past the limit, decodes FULL)"
