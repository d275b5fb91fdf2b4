"""What the host stages for one async step: named per-row columns, copied in one transfer.

The host knows a step's scheduling facts (which request slot a row serves, how many tokens it
runs, whether it samples); the device knows everything else. ``StepRows`` is a table of int64
columns ``[N, F]`` in a ``HostBuffer``; after the copy the device reads it through the record's
named views, never through column numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


class RowTable:
    """Base of a staged record: every dataclass field is one int64 column of an ``[N, F]`` table."""

    @classmethod
    def columns(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def pack(cls, rows: list[dict[str, int]]) -> list[list[int]]:
        """Host rows (one dict per row, keyed by field) as table rows."""
        cols = cls.columns()
        return [[int(row[c]) for c in cols] for row in rows]

    @classmethod
    def view(cls, table: torch.Tensor):
        """The record whose fields are the columns of ``table`` [N, F] (views, no copies)."""
        assert table.dim() == 2 and table.shape[1] == len(cls.columns()), (
            f"{cls.__name__}: table must be [N, F]"
        )
        return cls(*table.unbind(1))


@dataclass
class StepRows(RowTable):
    """Per-row facts of one step (N rows, decode rows first; padding rows at the end of a FULL step)."""

    idx: torch.Tensor  # [N] request slot; -1 for a padding row (its gathers read the state's sink row)
    query_len: torch.Tensor  # [N] tokens the row runs (committed tail, then drafts); 0 for padding
    is_decode: torch.Tensor  # [N] 1: the request is past its prompt (contract 2), else 0
    has_initial_state: torch.Tensor  # [N] 1: the request has computed tokens, so its state is live
    is_sampling: torch.Tensor  # [N] 1: the row reaches the request's last token and picks tokens
    # [N] draft positions at the row's tail: the host schedules K per decode row (the device's drafts, fillers
    # past their count); 0 for prefill rows, K for padding
    num_draft_positions: torch.Tensor
    backup_token: torch.Tensor  # [N] the prompt token after a prompt chunk that does not sample, else -1

    @classmethod
    def inert_row(cls, num_speculative_tokens: int, device) -> torch.Tensor:
        """[F] a padding row: no request slot, zero tokens, samples nothing. It carries K draft positions so
        a FULL step's logits count (1 + draft positions per row) depends on its padded size only."""
        values = {"idx": -1, "query_len": 0, "is_decode": 1, "has_initial_state": 1, "is_sampling": 0,
                  "num_draft_positions": num_speculative_tokens, "backup_token": 0}
        return torch.tensor(cls.pack([values])[0], dtype=torch.int64, device=device)
