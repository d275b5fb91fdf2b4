"""Fixtures for the pooled-state slot contract that the gated delta rule and Mamba2 share
(kernels/_recurrent_slots.py): varlen offsets, state pools filled with a sentinel, index tables with
padding rows, and the checks that a call touched only its own slots and that a row's results do not
depend on its neighbours.
"""

from __future__ import annotations

import torch

from kernels._testing import assert_close
from kernels.constants import PAD_SLOT_ID

HUGE = 1e30  # fills pool slots no call may read; any leak shows as a huge or non-finite value


def cu_seqlens_for(lens) -> torch.Tensor:
    """int32 ``[N+1]`` offsets of rows with the given lengths."""
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


def make_pool(num_slots: int, state_shape: tuple[int, ...], live) -> torch.Tensor:
    """Pool ``[num_slots, *state_shape]`` full of HUGE, with random states in the ``live`` slots."""
    pool = torch.full((num_slots, *state_shape), HUGE)
    for s in live:
        pool[s] = torch.randn(*state_shape) * 0.5
    return pool


def assert_untouched(before, after, touched):
    keep = torch.ones(before.shape[0], dtype=torch.bool)
    keep[list(touched)] = False
    assert torch.equal(before[keep], after[keep]), "a slot the call must not touch was modified"


def row_tokens(cu, i):
    return slice(int(cu[i]), int(cu[i + 1]))


def split_rows(cu, split) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row cut after its first ``split[i]`` tokens: (head token index, head offsets, tail token
    index, tail offsets), offsets int32 ``[N+1]``, to run a row's prefix and then its rest."""
    starts, ends = cu[:-1].tolist(), cu[1:].tolist()
    head = torch.cat([torch.arange(s, s + m) for s, m in zip(starts, split)])
    tail = torch.cat([torch.arange(s + m, e) for s, m, e in zip(starts, split, ends)])
    tail_lens = [e - s - m for s, m, e in zip(starts, split, ends)]
    return head, cu_seqlens_for(split), tail, cu_seqlens_for(tail_lens)


def assert_same_run(backend: str, what: str, expected, got, ratio: float) -> None:
    """Two ways to the same result: bitwise equal from the torch reference, within ``ratio`` from a
    Triton kernel (its launches for the two ways differ in shape)."""
    if backend == "torch":
        assert torch.equal(expected, got), f"{what}: not bitwise the same"
    else:
        assert_close(what, expected, got, ratio)


def rows_of(cu, rows: slice) -> tuple[slice, torch.Tensor]:
    """The tokens of a run of rows and their offsets rebased to 0 (int32): to call an op on those
    rows alone."""
    tokens = slice(int(cu[rows.start]), int(cu[rows.stop]))
    return tokens, (cu[rows.start:rows.stop + 1] - cu[rows.start]).to(torch.int32)


def index_table(slots: torch.Tensor, num_rows: int, spec: bool, pad_rows) -> torch.Tensor:
    """``state_indices`` from distinct pool slots: ``[N, K+1]`` when ``spec`` (row i takes the i-th run
    of K+1 slots), else ``[N]`` (the first of each run); the rows in ``pad_rows`` read PAD_SLOT_ID."""
    idx = slots.to(torch.int32).view(num_rows, -1).clone()
    idx[pad_rows, 0] = PAD_SLOT_ID
    return idx if spec else idx[:, 0].contiguous()


def assert_batch_invariant(run, cu, target, pool, idx, accepted, has_init):
    """Runs all rows, then row ``target`` alone, each on its own copy of ``pool``, and checks that row
    bitwise the same both ways. ``run(pool, rows: slice, idx, accepted, has_init)`` calls the op on the
    given rows with those rows' slot arguments (``accepted`` None for plain rows)."""
    batch_pool, alone_pool = pool.clone(), pool.clone()
    out_batch = run(batch_pool, slice(0, len(has_init)), idx, accepted, has_init)
    one = slice(target, target + 1)
    out_alone = run(alone_pool, one, idx[one], None if accepted is None else accepted[one], has_init[one])
    assert_row_alone_matches_batch(cu, target, idx, out_batch, out_alone, batch_pool, alone_pool)


def assert_row_alone_matches_batch(cu, target, idx, out_batch, out_alone, batch_pool, alone_pool):
    """Row ``target`` run among the others and alone: bitwise the same output and slot states."""
    assert torch.equal(out_batch[row_tokens(cu, target)], out_alone)
    mine = idx[target].long().flatten()
    assert torch.equal(batch_pool[mine], alone_pool[mine])
