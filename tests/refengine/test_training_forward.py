"""The dense training forward computes the same logits as the engine's cached forward.

Training optimises ``refengine.tools.training``; the engine serves ``Qwen3NextForCausalLM.forward``
and ``Qwen3NextMTPHead.forward`` over caches. Both run on the same parameters, so their outputs must agree.
"""

from __future__ import annotations

import pytest
import torch

from refengine.forward_context import AttnMetadata
from refengine.model import MTP_CACHE_KEY, load_model
from refengine.tools import training as tr
from tests.helpers.driver import Driver

REL_TOL = 1e-4
SEQ_LEN = 150  # crosses two chunk boundaries of the chunked delta rule


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return load_model(tiny_checkpoint("next-tiny"))


def _ids(vocab: int, n: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(11)).tolist()


def _attn(driver: Driver, positions: list[int]) -> AttnMetadata:
    bs = driver.block_size
    slots = [int(driver.block_table[0, p // bs]) * bs + p % bs for p in positions]
    return AttnMetadata(
        query_start_loc=torch.tensor([0, len(positions)], dtype=torch.int32),
        seq_lens=torch.tensor([positions[-1] + 1], dtype=torch.int32),
        block_table=driver.block_table[:1].contiguous(),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )


def test_main_logits_match_engine(tiny):
    model, cfg = tiny
    ids = _ids(cfg.vocab_size, SEQ_LEN)
    _, engine_logits, _ = Driver(model, cfg, 1, SEQ_LEN).prefill([ids])
    with torch.no_grad():
        ours = tr.logits(model, tr.hidden_states(model, torch.tensor([ids])))[0]
    assert rel_err(ours, engine_logits) < REL_TOL


@pytest.mark.parametrize("base", [5, 70, SEQ_LEN - 5])
def test_mtp_chain_matches_engine(tiny, base):
    """Training row ``base`` of MTP step s equals the engine's first pass + chained draft steps."""
    model, cfg = tiny
    ids = _ids(cfg.vocab_size, SEQ_LEN)
    steps = 3
    with torch.no_grad():
        hidden = tr.hidden_states(model, torch.tensor([ids]))
        chain = tr.mtp_hidden_chain(model, torch.tensor([ids]), hidden, steps)

    driver = Driver(model, cfg, 1, SEQ_LEN + steps)
    engine_hidden, _, _ = driver.prefill([ids[: base + 1]])
    kv = driver.kv_caches[MTP_CACHE_KEY]
    positions = list(range(base + 1))
    with torch.no_grad():
        out = model.mtp(torch.tensor(ids[1: base + 2]), engine_hidden, torch.tensor(positions),
                        _attn(driver, positions), kv)[-1:]
        for s in range(steps):
            if s:
                pos = [base + s]  # one query token attending to every cached position 0..base+s
                out = model.mtp(
                    torch.tensor([ids[base + s + 1]]), out, torch.tensor(pos), _attn(driver, pos), kv
                )
            ours, theirs = tr.logits(model, chain[s][0, base]), model.compute_logits(out)[0]
            assert rel_err(ours, theirs) < REL_TOL, f"step {s}"


def test_chunk_rule_matches_recurrence():
    gen = torch.Generator().manual_seed(3)
    b, t, h, dk, dv = 2, 70, 3, 8, 5
    q = tr.l2_normalize(torch.randn(b, t, h, dk, generator=gen)) * dk**-0.5
    k = tr.l2_normalize(torch.randn(b, t, h, dk, generator=gen))
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -torch.rand(b, t, h, generator=gen)
    beta = torch.rand(b, t, h, generator=gen)
    state = torch.zeros(b, h, dk, dv)
    ref = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        delta = (v[:, i] - torch.einsum("bhk,bhkv->bhv", k[:, i], state)) * beta[:, i, :, None]
        state = state + k[:, i, :, :, None] * delta[:, :, None, :]
        ref.append(torch.einsum("bhk,bhkv->bhv", q[:, i], state))
    ours = tr.chunk_delta_rule(q, k, v, g, beta, chunk=16)
    assert torch.allclose(ours, torch.stack(ref, dim=1), atol=1e-5)
