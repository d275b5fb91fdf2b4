"""prepare_inputs and post_update: the torch reference against explicit per-row loops, Triton ==
torch exactly, sentinel-filled request slots (nothing outside a step's rows is touched)."""

from __future__ import annotations

from types import MappingProxyType

import pytest
import torch

from kernels import KernelInputError
from kernels.constants import PAD_SLOT_ID
from kernels.input_prep import post_update, prepare_inputs
from tests.kernels.conftest import generator, requires_triton

# Values of request slots that no row of the step maps to; they must survive every call.
UNUSED = MappingProxyType({"num_computed": -11, "num_valid_state": -12, "last_sampled": -13, "token_ids": -14,
                           "num_tokens": -15, "draft_tokens": -16})
EMPTY_COL = -3  # token_ids columns at or past num_tokens of a used slot

# Token ids are drawn from disjoint ranges so an id tells which tensor it came from.
PROMPT_IDS, LAST_IDS, DRAFT_IDS, SAMPLED_IDS = (1, 30000), (30000, 40000), (40000, 50000), (50000, 60000)

# Rows: ("prefill", context, query_len, final_chunk) | ("decode", num_drafts, num_valid) | ("pad",).
# A final prefill chunk samples one token; a partial one samples nothing.
CASES = MappingProxyType({
    "k0-bs4": (
        (("prefill", 0, 5, True), ("decode", 0, 1), ("pad",), ("prefill", 6, 3, False), ("decode", 0, 1)),
        0, 4, 3,
    ),
    "k1-bs16": (
        (("decode", 1, 2), ("pad",), ("prefill", 17, 9, True), ("decode", 1, 1), ("pad",), ("pad",)),
        1, 16, 4,
    ),
    "k3-bs4": (
        (("decode", 3, 2), ("decode", 2, 3), ("prefill", 0, 7, False), ("pad",), ("decode", 0, 1),
         ("prefill", 13, 4, True), ("decode", 3, 4), ("pad",)),
        3, 4, 5,
    ),
    "k3-bs16-unpadded": (
        (("pad",), ("prefill", 30, 6, False), ("decode", 3, 1), ("pad",)),
        3, 16, 0,
    ),
    "all-padding": ((("pad",), ("pad",)), 1, 4, 4),
})
CASE_IDS = tuple(CASES)


def build(case: str, seed: int = 0):
    """Persistent request-slot state and one step's row tensors for CASES[case]."""
    rows, k, block_size, extra_pad = CASES[case]
    g = generator(seed)

    def rand(lo_hi, *shape):
        return torch.randint(lo_hi[0], lo_hi[1], shape, generator=g, dtype=torch.int64)

    n = len(rows)
    num_slots = n + 3
    slot_of_row = torch.randperm(num_slots, generator=g)[:n].tolist()
    # Per row: request slot, query length, context, num_tokens, drafts, num_valid, decode, sampling.
    spec = []
    for i, row in enumerate(rows):
        if row[0] == "pad":
            spec.append((PAD_SLOT_ID, 0, 0, 0, 0, 0, False, False))
        elif row[0] == "prefill":
            _, ctx, q, final = row
            prompt_len = ctx + q if final else ctx + q + 5
            spec.append((slot_of_row[i], q, ctx, prompt_len, 0, 1 if final else 0, False, final))
        else:
            _, nd, nv = row
            assert nd <= k and 1 <= nv <= nd + 1
            ctx = int(torch.randint(2, 26, (), generator=g))
            spec.append((slot_of_row[i], 1 + nd, ctx, ctx + 1, nd, nv, True, True))
    idx, qlens, ctxs, ntoks, drafts, nvalid, decode, sampling = (list(col) for col in zip(*spec))

    max_len = max(ntoks) + k + 3
    max_blocks = max(c + q for c, q in zip(ctxs, qlens)) // block_size + 2
    state = {
        "num_computed": torch.full((num_slots,), UNUSED["num_computed"], dtype=torch.int32),
        "num_valid_state": torch.full((num_slots,), UNUSED["num_valid_state"], dtype=torch.int32),
        "last_sampled": torch.full((num_slots,), UNUSED["last_sampled"], dtype=torch.int64),
        "token_ids": torch.full((num_slots, max_len), UNUSED["token_ids"], dtype=torch.int64),
        "num_tokens": torch.full((num_slots,), UNUSED["num_tokens"], dtype=torch.int32),
        "draft_tokens": torch.full((num_slots, k), UNUSED["draft_tokens"], dtype=torch.int64),
        "block_table": torch.randperm(num_slots * max_blocks, generator=g).view(num_slots, max_blocks).int(),
    }
    for i in range(n):
        r = idx[i]
        if r == PAD_SLOT_ID:
            continue
        state["num_computed"][r] = ctxs[i]
        state["num_valid_state"][r] = int(torch.randint(1, k + 2, (), generator=g))
        state["last_sampled"][r] = rand(LAST_IDS)
        state["token_ids"][r] = EMPTY_COL
        state["token_ids"][r, : ntoks[i]] = rand(PROMPT_IDS, ntoks[i])
        state["num_tokens"][r] = ntoks[i]
        state["draft_tokens"][r] = rand(DRAFT_IDS, k)

    sampled = torch.full((n, k + 1), -1, dtype=torch.int64)
    for i in range(n):
        if sampling[i]:
            sampled[i, : nvalid[i]] = rand(SAMPLED_IDS, nvalid[i])
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    step = {
        "idx_mapping": torch.tensor(idx, dtype=torch.int32),
        "query_start_loc": torch.tensor(qsl, dtype=torch.int32),
        "query_lens": torch.tensor(qlens, dtype=torch.int32),
        "is_decode": torch.tensor(decode, dtype=torch.bool),
        "num_draft_tokens": torch.tensor(drafts, dtype=torch.int32),
        "is_sampling": torch.tensor(sampling, dtype=torch.bool),
        "sampled": sampled,
        "num_valid": torch.tensor(nvalid, dtype=torch.int32),
        "block_size": block_size,
        "num_tokens_padded": qsl[-1] + extra_pad,
    }
    return state, step


def clone_state(state):
    return {name: t.clone() for name, t in state.items()}


def run_prepare(state, step, backend):
    return prepare_inputs(
        idx_mapping=step["idx_mapping"],
        query_start_loc=step["query_start_loc"],
        is_decode=step["is_decode"],
        num_computed=state["num_computed"],
        last_sampled=state["last_sampled"],
        draft_tokens=state["draft_tokens"],
        token_ids=state["token_ids"],
        block_table=state["block_table"],
        block_size=step["block_size"],
        num_tokens_padded=step["num_tokens_padded"],
        backend=backend,
    )


def run_post_update(state, step, backend):
    post_update(
        idx_mapping=step["idx_mapping"],
        query_lens=step["query_lens"],
        num_draft_tokens=step["num_draft_tokens"],
        is_sampling=step["is_sampling"],
        sampled=step["sampled"],
        num_valid=step["num_valid"],
        num_computed=state["num_computed"],
        num_valid_state=state["num_valid_state"],
        last_sampled=state["last_sampled"],
        token_ids=state["token_ids"],
        num_tokens=state["num_tokens"],
        backend=backend,
    )


def prepare_by_loop(state, step):
    """The spec, one token at a time."""
    bs, padded = step["block_size"], step["num_tokens_padded"]
    qsl = step["query_start_loc"].tolist()
    n = len(qsl) - 1
    ids, pos, slots, seq_lens = [0] * padded, [0] * padded, [PAD_SLOT_ID] * padded, [0] * n
    for i in range(n):
        r = int(step["idx_mapping"][i])
        if r == PAD_SLOT_ID:
            assert qsl[i + 1] == qsl[i], "padding rows carry no tokens in these cases"
            continue
        ctx = int(state["num_computed"][r])
        for j in range(qsl[i + 1] - qsl[i]):
            t, p = qsl[i] + j, ctx + j
            if step["is_decode"][i]:
                ids[t] = int(state["last_sampled"][r]) if j == 0 else int(state["draft_tokens"][r, j - 1])
            else:
                ids[t] = int(state["token_ids"][r, p])
            pos[t] = p
            slots[t] = int(state["block_table"][r, p // bs]) * bs + p % bs
        seq_lens[i] = ctx + qsl[i + 1] - qsl[i]
    i64 = torch.int64
    return (
        torch.tensor(ids, dtype=i64),
        torch.tensor(pos, dtype=i64),
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(slots, dtype=i64),
    )


def post_update_by_loop(state, step):
    """The spec, one row at a time, on a copy of ``state``."""
    out = clone_state(state)
    for i in range(step["idx_mapping"].shape[0]):
        r = int(step["idx_mapping"][i])
        if r == PAD_SLOT_ID:
            continue
        q = int(step["query_lens"][i])
        if not step["is_sampling"][i]:
            out["num_computed"][r] += q
            out["num_valid_state"][r] = 1
            continue
        nv = int(step["num_valid"][i])
        rejected = int(step["num_draft_tokens"][i]) - (nv - 1)
        out["num_computed"][r] += q - rejected
        out["num_valid_state"][r] = nv
        start = int(out["num_tokens"][r])
        for c in range(nv):
            out["token_ids"][r, start + c] = step["sampled"][i, c]
        out["num_tokens"][r] += nv
        out["last_sampled"][r] = step["sampled"][i, nv - 1]
    return out


def assert_same(name, got, expected):
    assert got.dtype == expected.dtype, f"{name}: dtype {got.dtype} != {expected.dtype}"
    assert torch.equal(got, expected), f"{name}:\n got      {got.tolist()}\n expected {expected.tolist()}"


PREPARE_NAMES = ("input_ids", "positions", "seq_lens", "slot_mapping")
STATE_NAMES = ("num_computed", "num_valid_state", "last_sampled", "token_ids", "num_tokens")


# ---- prepare_inputs ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASE_IDS)
def test_reference_prepare_matches_loop(case):
    state, step = build(case)
    before = clone_state(state)
    got = run_prepare(state, step, "torch")
    for name, g, e in zip(PREPARE_NAMES, got, prepare_by_loop(state, step)):
        assert_same(name, g, e)
    for name in state:
        assert torch.equal(state[name], before[name]), f"prepare_inputs modified {name}"


@requires_triton
@pytest.mark.parametrize("case", CASE_IDS)
def test_triton_prepare_equals_torch(case):
    state, step = build(case)
    expected = run_prepare(state, step, "torch")
    got = run_prepare(state, step, "triton")
    for name, g, e in zip(PREPARE_NAMES, got, expected):
        assert_same(name, g, e)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
def test_prepare_by_hand(backend):
    # Slot 1: decode at context 6 with 2 drafts; slot 0: prefill of prompt tokens 3..4; block size 4.
    idx = torch.tensor([1, PAD_SLOT_ID, 0], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    is_decode = torch.tensor([True, False, False])
    num_computed = torch.tensor([3, 6], dtype=torch.int32)
    last_sampled = torch.tensor([-5, 700])
    drafts = torch.tensor([[-6, -7, -8], [801, 802, 803]])
    token_ids = torch.tensor([[10, 11, 12, 13, 14, 15], [-1, -1, -1, -1, -1, -1]])
    block_table = torch.tensor([[9, 4, 0], [2, 5, 7]], dtype=torch.int32)
    ids, pos, seq_lens, slots = prepare_inputs(
        idx_mapping=idx, query_start_loc=qsl, is_decode=is_decode, num_computed=num_computed,
        last_sampled=last_sampled, draft_tokens=drafts, token_ids=token_ids, block_table=block_table,
        block_size=4, num_tokens_padded=7, backend=backend)
    assert ids.tolist() == [700, 801, 802, 13, 14, 0, 0]
    assert pos.tolist() == [6, 7, 8, 3, 4, 0, 0]
    assert seq_lens.tolist() == [9, 0, 5]
    # Positions 6, 7 sit in block 1 of slot 1 (block 5), 8 in its block 2 (block 7); 3 and 4 in
    # blocks 0 and 1 of slot 0 (blocks 9 and 4).
    assert slots.tolist() == [5 * 4 + 2, 5 * 4 + 3, 7 * 4 + 0, 9 * 4 + 3, 4 * 4 + 0, PAD_SLOT_ID, PAD_SLOT_ID]


# ---- post_update ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASE_IDS)
def test_reference_post_update_matches_loop(case):
    state, step = build(case)
    expected = post_update_by_loop(state, step)
    run_post_update(state, step, "torch")
    for name in state:
        assert_same(name, state[name], expected[name])


@requires_triton
@pytest.mark.parametrize("case", CASE_IDS)
def test_triton_post_update_equals_torch(case):
    state, step = build(case)
    expected = clone_state(state)
    run_post_update(expected, step, "torch")
    run_post_update(state, step, "triton")
    for name in state:
        assert_same(name, state[name], expected[name])


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("case", CASE_IDS)
def test_post_update_semantics(case, backend):
    state, step = build(case)
    before = clone_state(state)
    run_post_update(state, step, backend)
    used = set()
    for i in range(step["idx_mapping"].shape[0]):
        r = int(step["idx_mapping"][i])
        if r == PAD_SLOT_ID:
            continue
        used.add(r)
        q, nd = int(step["query_lens"][i]), int(step["num_draft_tokens"][i])
        nc0, nt0 = int(before["num_computed"][r]), int(before["num_tokens"][r])
        if not step["is_sampling"][i]:  # partial prefill: advances by q, samples nothing
            assert int(state["num_computed"][r]) == nc0 + q
            assert int(state["num_valid_state"][r]) == 1
            for name in ("token_ids", "num_tokens", "last_sampled"):
                assert torch.equal(state[name][r], before[name][r]), f"row {i}: {name} changed"
            continue
        nv = int(step["num_valid"][i])
        kept = step["sampled"][i, :nv]
        # Computed: every non-draft token of the row plus the accepted drafts (nv - 1 of them).
        assert int(state["num_computed"][r]) == nc0 + (q - nd) + (nv - 1), f"row {i}: num_computed"
        assert int(state["num_valid_state"][r]) == nv, f"row {i}: num_valid_state"
        assert int(state["num_tokens"][r]) == nt0 + nv, f"row {i}: num_tokens"
        assert int(state["last_sampled"][r]) == int(kept[-1]), f"row {i}: last_sampled"
        assert torch.equal(state["token_ids"][r, :nt0], before["token_ids"][r, :nt0]), f"row {i}: history"
        assert torch.equal(state["token_ids"][r, nt0 : nt0 + nv], kept), f"row {i}: appended tokens"
        assert torch.all(state["token_ids"][r, nt0 + nv :] == EMPTY_COL), (
            f"row {i}: wrote past the kept tokens"
        )
        # Every sampled token but the last is now computed; the last is the next step's input.
        assert int(state["num_tokens"][r]) == int(state["num_computed"][r]) + 1, f"row {i}: off by one"
    unused = [r for r in range(state["num_computed"].shape[0]) if r not in used]
    assert unused, "every case leaves some request slots unused"
    for name in STATE_NAMES:
        assert torch.all(state[name][unused] == UNUSED[name]), f"{name} of an unused request slot changed"


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
def test_post_update_by_hand(backend):
    # Row 0 -> slot 2: decode with 3 drafts, 1 accepted (num_valid 2). Row 1: padding.
    # Row 2 -> slot 0: partial prefill of 4 tokens. Slot 1 belongs to no row.
    idx = torch.tensor([2, PAD_SLOT_ID, 0], dtype=torch.int32)
    query_lens = torch.tensor([4, 0, 4], dtype=torch.int32)
    num_drafts = torch.tensor([3, 0, 0], dtype=torch.int32)
    is_sampling = torch.tensor([True, False, False])
    sampled = torch.tensor([[500, 501, -1, -1], [-1, -1, -1, -1], [-1, -1, -1, -1]])
    num_valid = torch.tensor([2, 0, 0], dtype=torch.int32)
    num_computed = torch.tensor([0, 77, 10], dtype=torch.int32)
    num_valid_state = torch.tensor([3, 77, 4], dtype=torch.int32)
    last_sampled = torch.tensor([-1, 77, 300])
    token_ids = torch.arange(3 * 14).view(3, 14)
    num_tokens = torch.tensor([9, 77, 11], dtype=torch.int32)
    post_update(
        idx_mapping=idx,
        query_lens=query_lens,
        num_draft_tokens=num_drafts,
        is_sampling=is_sampling,
        sampled=sampled,
        num_valid=num_valid,
        num_computed=num_computed,
        num_valid_state=num_valid_state,
        last_sampled=last_sampled,
        token_ids=token_ids,
        num_tokens=num_tokens,
        backend=backend,
    )
    assert num_computed.tolist() == [4, 77, 12]  # 10 + 4 computed - 2 rejected drafts
    assert num_valid_state.tolist() == [1, 77, 2]
    assert last_sampled.tolist() == [-1, 77, 501]
    assert num_tokens.tolist() == [9, 77, 13]
    expected = torch.arange(3 * 14).view(3, 14)
    expected[2, 11:13] = torch.tensor([500, 501])
    assert torch.equal(token_ids, expected)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
def test_next_step_reads_committed_state(backend):
    # After a step is committed, a decode row's next input is its last kept token, at the position
    # right after the accepted ones; a continuing prefill reads the next prompt tokens.
    state, step = build("k3-bs4")
    run_post_update(state, step, backend)
    n = step["idx_mapping"].shape[0]
    next_q = [1 if step["is_sampling"][i] else 2 for i in range(n)]
    next_q = [q if int(step["idx_mapping"][i]) != PAD_SLOT_ID else 0 for i, q in enumerate(next_q)]
    qsl = torch.tensor([0] + torch.tensor(next_q).cumsum(0).tolist(), dtype=torch.int32)
    ids, pos, seq_lens, _ = prepare_inputs(
        idx_mapping=step["idx_mapping"],
        query_start_loc=qsl,
        is_decode=step["is_sampling"].clone(),
        num_computed=state["num_computed"],
        last_sampled=state["last_sampled"],
        draft_tokens=state["draft_tokens"],
        token_ids=state["token_ids"],
        block_table=state["block_table"],
        block_size=step["block_size"],
        num_tokens_padded=int(qsl[-1]),
        backend=backend,
    )
    for i in range(n):
        r = int(step["idx_mapping"][i])
        if r == PAD_SLOT_ID:
            assert int(seq_lens[i]) == 0
            continue
        t = int(qsl[i])
        nc = int(state["num_computed"][r])
        assert int(pos[t]) == nc and int(seq_lens[i]) == nc + next_q[i]
        if step["is_sampling"][i]:
            nv = int(step["num_valid"][i])
            assert int(ids[t]) == int(step["sampled"][i, nv - 1]) == int(state["token_ids"][r, nc])
        else:
            assert ids[t : t + 2].tolist() == state["token_ids"][r, nc : nc + 2].tolist()


# ---- wrapper checks ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
def test_wrong_shapes_are_refused_by_name(backend):
    state, step = build("k1-bs16")
    short = dict(state, num_tokens=state["num_tokens"][:-1])
    message = r"post_update: num_tokens must be an int32 or int64 tensor of shape \[R\] = \[9\]"
    with pytest.raises(KernelInputError, match=message):
        run_post_update(short, step, backend)
    bad = dict(step, is_decode=step["is_decode"].int())
    with pytest.raises(KernelInputError, match="prepare_inputs: is_decode must be a bool tensor"):
        run_prepare(state, bad, backend)


@requires_triton
def test_triton_takes_int64_rows_and_a_strided_block_table():
    # The wrappers narrow int64 row tensors and copy a column-major block table; the same results.
    state, step = build("k1-bs16")
    expected = run_prepare(state, step, "torch")
    strided = dict(state, block_table=state["block_table"].t().contiguous().t())
    got = run_prepare(strided, dict(step, idx_mapping=step["idx_mapping"].long()), "triton")
    for name, g, e in zip(PREPARE_NAMES, got, expected):
        assert_same(name, g, e)


def _forbid_host_reads(m: pytest.MonkeyPatch) -> None:
    def host_read(*args, **kwargs):
        raise RuntimeError("host read of a device value")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__"):
        m.setattr(torch.Tensor, name, host_read)


@requires_triton
def test_triton_wrappers_do_not_read_device_values(monkeypatch):
    # Every path from a tensor's value to the host goes through one of the patched methods; the
    # Triton wrappers must take none of them (the torch reference does: int(query_start_loc[-1])).
    state, step = build("k3-bs4")
    expected = run_prepare(state, step, "torch")
    with monkeypatch.context() as m:
        _forbid_host_reads(m)
        got = run_prepare(state, step, "triton")
        run_post_update(state, step, "triton")
        with pytest.raises(RuntimeError, match="host read"):
            run_prepare(state, step, "torch")
    for name, g, e in zip(PREPARE_NAMES, got, expected):
        assert_same(name, g, e)
    assert not torch.equal(state["num_tokens"], build("k3-bs4")[0]["num_tokens"]), "post_update did not run"
