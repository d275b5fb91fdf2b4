"""Reference for ``greedy_verify``: accept draft tokens while they equal the target's argmax."""

from __future__ import annotations

import torch

from kernels.verify.contract import check_greedy_verify_inputs


def naive_greedy_verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    cu_num_logits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``output_tokens`` int64 ``[N, K+1]`` and ``num_valid`` int32 ``[N]``.

    Row i owns logits rows ``cu_num_logits[i] .. cu_num_logits[i] + num_draft_tokens[i]``. With
    ``target[j]`` the argmax of its logits row j (lowest index on ties) and ``m`` the first j where
    ``draft[j] != target[j]`` (``num_draft_tokens[i]`` when all match), the row's output is
    ``target[0..m]`` followed by ``-1``; ``num_valid[i] = m + 1``.
    """
    n, k = check_greedy_verify_inputs(target_logits, draft_tokens, num_draft_tokens, cu_num_logits)
    device = target_logits.device
    if n == 0:
        return torch.empty(0, k + 1, dtype=torch.int64, device=device), torch.empty(
            0, dtype=torch.int32, device=device
        )
    num_drafts = num_draft_tokens.long()
    targets = torch.argmax(target_logits, dim=-1)  # every row owns at least one logits row
    j = torch.arange(k + 1, device=device)
    owned = j[None, :] <= num_drafts[:, None]  # [N, K+1]: logits rows row i owns
    rows = (cu_num_logits[:-1].long()[:, None] + j[None, :]).where(owned, 0)
    row_targets = targets[rows]  # [N, K+1]
    matches = (draft_tokens.long() == row_targets[:, :k]) & owned[:, 1:]
    num_accepted = matches.long().cumprod(dim=1).sum(dim=1)  # leading matches, <= num_drafts
    keep = j[None, :] <= num_accepted[:, None]
    output_tokens = torch.where(keep, row_targets, torch.full_like(row_targets, -1))
    return output_tokens, (num_accepted + 1).to(torch.int32)
