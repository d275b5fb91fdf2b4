"""Causal conv1d: the window contract pinned with exact integer inputs, Triton against the torch
reference, and the pool / padding contract (sentinel-filled pools checked bitwise)."""

from __future__ import annotations

import pytest
import torch

from kernels._testing import assert_close
from kernels.constants import PAD_SLOT_ID
from kernels.conv1d import causal_conv1d_fn, causal_conv1d_update
from tests.kernels.conftest import requires_triton

HUGE = 1e30
RATIO = 2e-3
BACKENDS = ["torch", pytest.param("triton", marks=requires_triton)]


def cu_of(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def int_tensor(*shape, lo=-3, hi=4):
    """Small integers as float32: every product and sum below is exact."""
    return torch.randint(lo, hi, shape).float()


def manual_conv(window, x_row, weight):
    """out[t, c] = sum_j w[c, j] * full[c, t + j], written as loops."""
    full = torch.cat([window, x_row.t()], dim=1)
    width, length = weight.shape[1], x_row.shape[0]
    out = torch.zeros(length, weight.shape[0])
    for t in range(length):
        for j in range(width):
            out[t] += weight[:, j] * full[:, t + j]
    return out, full


# ------------------------------------------------------------------ window contract, exact

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width,length", [(4, 1), (4, 2), (4, 6), (2, 3), (3, 1)])
def test_prefill_window_contract_exact(backend, width, length):
    channels, k_spec = 6, 2
    state = torch.full((3, channels, width - 1 + k_spec), HUGE)
    state[1] = int_tensor(channels, width - 1 + k_spec)
    state[1, :, width - 1:] = HUGE                                   # columns >= W-1: untouched
    before = state.clone()
    x, weight = int_tensor(length, channels), int_tensor(channels, width)
    out = causal_conv1d_fn(x, weight, state, cu_of([length]), torch.tensor([1], dtype=torch.int32),
                           torch.tensor([True]), activation=None, backend=backend)
    expect, full = manual_conv(before[1, :, :width - 1], x, weight)
    assert torch.equal(out, expect)
    assert torch.equal(state[1, :, :width - 1], full[:, -(width - 1):])
    assert torch.equal(state[1, :, width - 1:], before[1, :, width - 1:])
    assert torch.equal(state[[0, 2]], before[[0, 2]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("accepted", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [1, 2, 4])
def test_update_window_contract_exact(backend, accepted, length):
    channels, width, k_spec = 5, 4, 3
    state = torch.full((2, channels, width - 1 + k_spec), HUGE)
    state[0] = int_tensor(channels, width - 1 + k_spec)
    before = state.clone()
    x, weight = int_tensor(length, channels), int_tensor(channels, width)
    idx = torch.tensor([[0, PAD_SLOT_ID, PAD_SLOT_ID, PAD_SLOT_ID]], dtype=torch.int32)
    out = causal_conv1d_update(x, weight, state, cu_of([length]), idx,
                               num_valid=torch.tensor([accepted], dtype=torch.int32),
                               activation=None, backend=backend)
    window = before[0, :, accepted - 1:accepted - 1 + width - 1]
    expect, full = manual_conv(window, x, weight)
    assert torch.equal(out, expect)
    written = width - 2 + length
    assert torch.equal(state[0, :, :written], full[:, 1:])
    assert torch.equal(state[0, :, written:], before[0, :, written:])
    assert torch.equal(state[1], before[1])
    # The window after token j of this step sits at columns j .. j+W-2.
    for j in range(length):
        assert torch.equal(state[0, :, j:j + width - 1], full[:, j + 1:j + width])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("accepted", [1, 2, 3, 4])
def test_spec_continuation_matches_fresh_prefill(backend, accepted):
    """Prefill a history, verify K+1 drafts, keep ``accepted`` of them, verify again: equals a
    prefill over history + accepted drafts + new tokens."""
    channels, width, k_spec = 7, 4, 3
    history, drafts = torch.randn(5, channels), torch.randn(k_spec + 1, channels)
    nxt = torch.randn(2, channels)
    weight = torch.randn(channels, width)
    idx, state = torch.tensor([0], dtype=torch.int32), torch.randn(1, channels, width - 1 + k_spec)
    causal_conv1d_fn(history, weight, state, cu_of([5]), idx, torch.tensor([False]), backend=backend)
    causal_conv1d_update(drafts, weight, state, cu_of([k_spec + 1]), idx, backend=backend)
    a = torch.tensor([accepted], dtype=torch.int32)
    out = causal_conv1d_update(nxt, weight, state, cu_of([2]), idx, num_valid=a, backend=backend)
    seq = torch.cat([history, drafts[:accepted], nxt])
    fresh_state = torch.zeros(1, channels, width - 1 + k_spec)
    fresh = causal_conv1d_fn(seq, weight, fresh_state, cu_of([len(seq)]), idx, torch.tensor([False]),
                             backend=backend)
    assert torch.equal(out, fresh[-2:])
    # After the 2-token step with offset a'-1 = 1 the live window is columns 1..W-1.
    assert torch.equal(state[0, :, 1:width], seq[-(width - 1):].t())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("accepted", [1, 3])
def test_prefill_and_update_forms_bitwise_equal(backend, accepted):
    channels, width, k_spec, length = 9, 4, 2, 3
    x, weight = torch.randn(length, channels), torch.randn(channels, width)
    window = torch.randn(channels, width - 1)
    s_fn = torch.zeros(1, channels, width - 1 + k_spec)
    s_fn[0, :, :width - 1] = window
    s_up = torch.zeros(1, channels, width - 1 + k_spec)
    s_up[0, :, accepted - 1:accepted - 1 + width - 1] = window
    idx = torch.tensor([0], dtype=torch.int32)
    o_fn = causal_conv1d_fn(x, weight, s_fn, cu_of([length]), idx, torch.tensor([True]), backend=backend)
    a = torch.tensor([accepted], dtype=torch.int32)
    o_up = causal_conv1d_update(x, weight, s_up, cu_of([length]), idx, num_valid=a, backend=backend)
    assert torch.equal(o_fn, o_up)


# ---------------------------------------------------------------- Triton against the reference

CONV_CASES = [
    # lens, C, W, K
    ([1], 8, 4, 0),
    ([2, 0, 17], 20, 4, 0),
    ([63, 1], 36, 3, 1),
    ([65], 12, 2, 0),
]


@requires_triton
@pytest.mark.parametrize("lens,channels,width,k_spec", [pytest.param(*c, id="L{}-C{}-W{}-K{}".format(*c))
                                                        for c in CONV_CASES])
def test_fn_triton_matches_reference(lens, channels, width, k_spec):
    n = len(lens)
    x = torch.randn(sum(lens) + 2, channels)
    weight = torch.randn(channels, width)
    idx = torch.randperm(n + 2)[:n].to(torch.int32)
    has_init = torch.tensor([i % 2 == 1 for i in range(n)])
    state = torch.full((n + 2, channels, width - 1 + k_spec), HUGE)
    state[idx.long()] = torch.randn(n, channels, width - 1 + k_spec)
    states = {b: state.clone() for b in ("torch", "triton")}
    outs = {b: causal_conv1d_fn(x, weight, states[b], cu_of(lens), idx, has_init, backend=b) for b in states}
    assert_close("out", outs["torch"], outs["triton"], RATIO)
    assert torch.equal(outs["triton"][sum(lens):], torch.zeros(2, channels))
    assert_close("state", states["torch"], states["triton"], RATIO)
    live = [s for s, n_ in zip(idx.tolist(), lens) if n_ > 0]
    keep = torch.ones(n + 2, dtype=torch.bool)
    keep[live] = False
    assert torch.equal(states["triton"][keep], state[keep])
    assert torch.equal(states["triton"][live][:, :, width - 1:], state[live][:, :, width - 1:])


UPDATE_CASES = [
    # lens, C, W, K
    ([1, 1, 0, 1], 20, 4, 0),
    ([3, 1, 0, 4, 2], 12, 4, 3),
    ([2, 2], 36, 3, 1),
]


@requires_triton
@pytest.mark.parametrize("lens,channels,width,k_spec", [pytest.param(*c, id="L{}-C{}-W{}-K{}".format(*c))
                                                        for c in UPDATE_CASES])
def test_update_triton_matches_reference(lens, channels, width, k_spec):
    n = len(lens)
    x = torch.randn(sum(lens) + 1, channels)
    weight = torch.randn(channels, width)
    idx = torch.randperm(n + 2)[:n].to(torch.int32).view(n, 1).repeat(1, k_spec + 1)
    idx[0, :] = PAD_SLOT_ID
    accepted = torch.randint(1, k_spec + 2, (n,), dtype=torch.int32) if k_spec else None
    state = torch.full((n + 2, channels, width - 1 + k_spec), HUGE)
    state[idx[1:, 0].long()] = torch.randn(n - 1, channels, width - 1 + k_spec)
    states = {b: state.clone() for b in ("torch", "triton")}
    outs = {b: causal_conv1d_update(x, weight, states[b], cu_of(lens), idx, num_valid=accepted,
                                    backend=b) for b in states}
    assert_close("out", outs["torch"], outs["triton"], RATIO)
    assert torch.equal(outs["triton"][:lens[0]], torch.zeros(lens[0], channels))
    assert_close("state", states["torch"][idx[1:, 0].long()], states["triton"][idx[1:, 0].long()], RATIO)
    for b in states:   # bitwise: everything the call must not write
        for i in range(n):
            s = int(idx[i, 0])
            written = 0 if s == PAD_SLOT_ID or lens[i] == 0 else width - 2 + lens[i]
            if s != PAD_SLOT_ID:
                assert torch.equal(states[b][s, :, written:], state[s, :, written:])


# ------------------------------------------------------------- batch invariance, padding, dtype

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["fn", "update"])
def test_batch_invariance(backend, form):
    channels, width, k_spec = 20, 4, 2
    lens = [3, 2, 0, 1] if form == "update" else [9, 5, 0, 30]
    x = torch.randn(sum(lens) + 3, channels)
    weight = torch.randn(channels, width)
    idx = torch.tensor([3, 1, PAD_SLOT_ID, 0], dtype=torch.int32)
    state = torch.randn(4, channels, width - 1 + k_spec)
    accepted = torch.tensor([2, 3, 1, 1], dtype=torch.int32)
    has_init = torch.tensor([True, False, True, True])
    cu = cu_of(lens)

    def run(st, rows):
        sub_cu = (cu[rows.start:rows.stop + 1] - cu[rows.start]).to(torch.int32)
        xs = x[int(cu[rows.start]):int(cu[rows.stop])]
        if form == "fn":
            return causal_conv1d_fn(xs, weight, st, sub_cu, idx[rows], has_init[rows], backend=backend)
        return causal_conv1d_update(xs, weight, st, sub_cu, idx[rows], num_valid=accepted[rows],
                                    backend=backend)

    s_batch, s_alone = state.clone(), state.clone()
    out_batch = run(s_batch, slice(0, 4))
    out_alone = run(s_alone, slice(1, 2))
    assert torch.equal(out_batch[int(cu[1]):int(cu[2])], out_alone)
    assert torch.equal(s_batch[1], s_alone[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_pad_and_empty_rows_write_nothing(backend):
    channels, width = 8, 4
    x, weight = torch.randn(3, channels), torch.randn(channels, width)
    state = torch.full((2, channels, width - 1), HUGE)
    before = state.clone()
    idx = torch.tensor([PAD_SLOT_ID, 1], dtype=torch.int32)
    cu = cu_of([3, 0])
    out = causal_conv1d_fn(x, weight, state, cu, idx, torch.tensor([False, False]), backend=backend)
    out_up = causal_conv1d_update(x, weight, state, cu, idx, backend=backend)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(out_up, torch.zeros_like(out_up))
    assert torch.equal(state, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_state_and_output(backend):
    channels, width = 16, 4
    x = torch.randn(4, channels, dtype=torch.bfloat16)
    weight = torch.randn(channels, width, dtype=torch.bfloat16)
    state = torch.zeros(1, channels, width - 1, dtype=torch.bfloat16)
    idx = torch.tensor([0], dtype=torch.int32)
    out = causal_conv1d_fn(x, weight, state, cu_of([4]), idx, torch.tensor([False]), backend=backend)
    assert out.dtype == torch.bfloat16
    assert torch.equal(state[0], x[-(width - 1):].t())


@pytest.mark.cpu_only
def test_reference_update_batch_invariance_large_batch():
    """Many rows and channels (torch splits work across threads): a row is still bitwise the same."""
    rows, channels, width, k_spec, target = 64, 256, 4, 3, 9
    lens = torch.randint(0, k_spec + 2, (rows,)).tolist()
    lens[target] = 3
    cu = cu_of(lens)
    x, weight = torch.randn(sum(lens), channels), torch.randn(channels, width)
    idx = torch.randperm(rows).to(torch.int32)
    idx[::5] = PAD_SLOT_ID
    slot = int(idx[target])
    accepted = torch.randint(1, k_spec + 2, (rows,), dtype=torch.int32)
    state = torch.randn(rows, channels, width - 1 + k_spec)
    s_batch, s_alone = state.clone(), state.clone()
    out = causal_conv1d_update(x, weight, s_batch, cu, idx, num_valid=accepted, backend="torch")
    tok = slice(int(cu[target]), int(cu[target + 1]))
    alone = causal_conv1d_update(x[tok], weight, s_alone, cu_of([3]), idx[target:target + 1],
                                 num_valid=accepted[target:target + 1], backend="torch")
    assert torch.equal(out[tok], alone)
    assert torch.equal(s_batch[slot], s_alone[slot])


# ----------------------------------------------------------------------------------- with a bias

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["fn", "update"])
def test_bias_exact(backend, form):
    """Nemotron-H's conv has a bias: out = act(bias + taps), exact on small integers, windows unchanged by
    it; the same call without a bias gives the bias-free result (existing callers unchanged)."""
    channels, width, k_spec, length, accepted = 7, 4, 2, 3, 2
    state = torch.full((2, channels, width - 1 + k_spec), HUGE)
    state[1] = int_tensor(channels, width - 1 + k_spec)
    before = state.clone()
    x, weight, bias = int_tensor(length, channels), int_tensor(channels, width), int_tensor(channels)
    idx = torch.tensor([1], dtype=torch.int32)

    def run(s, b):
        if form == "fn":
            return causal_conv1d_fn(x, weight, s, cu_of([length]), idx, torch.tensor([True]), bias=b,
                                    activation=None, backend=backend)
        return causal_conv1d_update(x, weight, s, cu_of([length]), idx,
                                    num_valid=torch.tensor([accepted], dtype=torch.int32), bias=b,
                                    activation=None, backend=backend)

    out = run(state, bias)
    plain_state = before.clone()
    plain = run(plain_state, None)
    offset = 0 if form == "fn" else accepted - 1
    expect, _ = manual_conv(before[1, :, offset:offset + width - 1], x, weight)
    assert torch.equal(plain, expect)
    assert torch.equal(out, expect + bias[None, :])
    assert torch.equal(state, plain_state)


@requires_triton
def test_bias_with_silu_triton_matches_reference():
    lens, channels, width = [5, 0, 3], 20, 4
    x, weight, bias = torch.randn(sum(lens), channels), torch.randn(channels, width), torch.randn(channels)
    idx = torch.tensor([2, 0, 1], dtype=torch.int32)
    has_init = torch.tensor([True, True, False])
    state = torch.randn(3, channels, width - 1)
    outs, states = {}, {}
    for backend in ("torch", "triton"):
        states[backend] = state.clone()
        outs[backend] = causal_conv1d_fn(x, weight, states[backend], cu_of(lens), idx, has_init, bias=bias,
                                         backend=backend)
    assert_close("out", outs["torch"], outs["triton"], RATIO)
    assert torch.equal(states["torch"], states["triton"])
