"""The pooled-state slot contract shared by the recurrent-state ops (gated delta rule, Mamba2).

Both ops keep one state per sequence in a pool ``ssm_state[S, ...]`` and take the same slot
arguments (kernels/README.md): ``cu_seqlens [N+1]``, ``state_indices [N]`` (plain rows: read from
and write back to ``idx[i]``) or ``[N, K+1]`` (speculative rows: read column
``num_valid[i] - 1``, write the state after token t to column t, PAD columns not
written), and ``has_initial_state [N]`` (False: start from zeros whatever the slot holds). A row
whose read slot is ``PAD_SLOT_ID`` and a row of length 0 read and write nothing.

This module holds that contract once: the input check both ops' ``contract.py`` call, and the
small steps both torch references take to resolve rows and slots.
"""

from __future__ import annotations

import torch

from kernels._contract import BOOL, INDEX, Contract, describe
from kernels.constants import PAD_SLOT_ID

# ------------------------------------------------------------------------------ input contract


def check_slot_inputs(c: Contract, state_indices, has_initial_state, num_valid=None, *,
                      speculative: bool) -> None:
    """Checks ``state_indices`` (``[N]``, or also ``[N, K+1]`` when ``speculative``), the
    ``num_valid [N]`` that 2-D indices need, and the optional ``has_initial_state [N]``.
    ``N`` must already be bound (by ``c.offsets("cu_seqlens", ...)``)."""
    if not speculative:
        c.tensor("state_indices", state_indices, INDEX, "N")
    else:
        c.tensor("state_indices", state_indices, INDEX, "N", "N, K+1")
        if state_indices.dim() == 2:
            c.at_least("state_indices", "K+1", 1)
            c.require(num_valid is not None, "num_valid",
                      "an int32 or int64 tensor of shape [N] with 2-D state_indices", "None")
            c.tensor("num_valid", num_valid, INDEX, "N")
        else:
            c.require(num_valid is None, "num_valid", "None with 1-D state_indices",
                      describe(num_valid))
    c.tensor("has_initial_state", has_initial_state, BOOL, "N", optional=True)


# ------------------------------------------------------------------------ reference-side steps


def row_bounds(cu_seqlens: torch.Tensor) -> tuple[list[int], list[int]]:
    """Each row's first token and length, from ``cu_seqlens [N+1]``."""
    cu = cu_seqlens.tolist()
    return cu[:-1], [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]


def initial_state_flags(has_initial_state: torch.Tensor | None, num_rows: int) -> list[bool]:
    """Whether each row starts from its slot's state (None: every row does)."""
    return [True] * num_rows if has_initial_state is None else has_initial_state.tolist()


def read_slots(state_indices: torch.Tensor, num_valid, lens: list[int]) -> list[int]:
    """The pool slot each row reads its initial state from; PAD_SLOT_ID where the row is skipped
    (a PAD read slot, or length 0). 1-D indices: ``idx[i]``; 2-D: column ``num_valid[i] - 1``."""
    if state_indices.dim() == 1:
        return [PAD_SLOT_ID if n == 0 else s for s, n in zip(state_indices.tolist(), lens)]
    idx = state_indices.tolist()
    accepted = num_valid.tolist()
    slots = []
    for i, row in enumerate(idx):
        if row[0] == PAD_SLOT_ID or lens[i] == 0:
            slots.append(PAD_SLOT_ID)
            continue
        assert 1 <= accepted[i] <= len(row), f"row {i}: num_valid {accepted[i]} out of range"
        assert lens[i] <= len(row), f"row {i}: {lens[i]} tokens but only {len(row)} state columns"
        slots.append(row[accepted[i] - 1])
    return slots


def gather_initial_states(ssm_state: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``ssm_state[slots]`` in float32, zeros where ``keep`` is False: masked (not multiplied) so
    that garbage or NaN in a recycled slot cannot leak in. ssm_state: [S, H, a, b]; slots, keep: [R];
    returns [R, H, a, b]."""
    return torch.where(keep[:, None, None, None], ssm_state[slots].float(), 0.0)


def write_token_states(ssm_state: torch.Tensor, state: torch.Tensor, columns: list[list[int]],
                       t: int) -> None:
    """Speculative rows: write the state after token t of each of the first ``n`` rows (``state
    [n, H, a, b]``) to that row's column t (``columns[j]``: row j's ``state_indices`` row); PAD
    columns are not written."""
    write = [j for j in range(state.shape[0]) if columns[j][t] != PAD_SLOT_ID]
    dst = torch.tensor([columns[j][t] for j in write], dtype=torch.long, device=state.device)
    ssm_state[dst] = state[write].to(ssm_state.dtype)
