"""Reference for ``paged_attention``: causal attention over a paged KV cache, online softmax.

Every query token visits the keys of its row in tiles of ``block_size`` from position 0 and keeps
a running max ``m``, running sum ``l`` and accumulator ``acc`` (all float32). Scores and the P@V
product are elementwise products summed over the innermost dimension (head dim for the scores,
the tile's key axis for P@V): no matmul mixes query tokens, so a token's output depends only on
its position and the keys, whatever other tokens share the call and however a prompt is split
into chunks. A tile lying wholly after a token's position is skipped: it would be an exact no-op
(``m`` unchanged, rescale factor ``exp(0) = 1``, nothing added).
"""

from __future__ import annotations

import torch

from kernels.attention.contract import check_paged_attention_inputs
from kernels.kv_cache.naive import token_rows


def token_positions(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row (int64) and absolute position (int64) of every token in ``[0, query_start_loc[N])``:
    token j of row i sits at ``seq_lens[i] - qlen_i + j``."""
    rows = token_rows(query_start_loc)
    starts = query_start_loc.long()
    qlens = starts[1:] - starts[:-1]
    index_in_row = torch.arange(rows.numel(), device=rows.device) - starts[rows]
    return rows, seq_lens.long()[rows] - qlens[rows] + index_in_row


def naive_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """``q [T, Hq, D]``, caches ``[num_blocks, block_size, Hkv, D]`` -> ``o [T, Hq, D]`` in ``q.dtype``."""
    num_tokens_padded, num_q_heads, head_dim, block_size, num_kv_heads, _ = check_paged_attention_inputs(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale)
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens_padded, num_kv_heads, group, head_dim, dtype=torch.float32, device=q.device)
    rows, positions = token_positions(query_start_loc, seq_lens)
    num_tokens = rows.numel()
    if num_tokens == 0:
        return out.view(num_tokens_padded, num_q_heads, head_dim).to(q.dtype)

    # Tokens sorted by position, latest first: the tokens that see tile b (position >= b *
    # block_size) are then a prefix, and the running state of that prefix is updated in place.
    order = torch.argsort(positions, descending=True, stable=True)
    pos_sorted, rows_sorted = positions[order], rows[order]
    # Query head h = kv_head * group + g uses KV head kv_head = h // group.
    q32 = q[:num_tokens][order].float().view(num_tokens, num_kv_heads, group, 1, head_dim)
    m = torch.full((num_tokens, num_kv_heads, group), float("-inf"), device=q.device)
    l = torch.zeros(num_tokens, num_kv_heads, group, device=q.device)
    acc = torch.zeros(num_tokens, num_kv_heads, group, head_dim, device=q.device)
    offsets = torch.arange(block_size, device=q.device)
    num_tiles = int(pos_sorted[0]) // block_size + 1
    for tile in range(num_tiles):
        a = int((pos_sorted >= tile * block_size).sum())  # tile 0 is seen by every token
        blocks = block_table[rows_sorted[:a], tile].long()
        hidden = tile * block_size + offsets[None, :] > pos_sorted[:a, None]  # [a, block_size]
        # Keys [a, Hkv, 1, block_size, D]; values [a, Hkv, 1, D, block_size], zero where hidden
        # (slots past a row's end may hold garbage, even NaN).
        k_tile = k_cache[blocks].float().permute(0, 2, 1, 3).unsqueeze(2)
        v_tile = v_cache[blocks].float().masked_fill_(hidden[:, :, None, None], 0.0)
        v_tile = v_tile.permute(0, 2, 3, 1).contiguous().unsqueeze(2)  # the sum below runs over stride 1
        scores = (q32[:a] * k_tile).sum(dim=-1) * scale  # [a, Hkv, G, block_size]
        scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m[:a], scores.amax(dim=-1))
        alpha = torch.exp(m[:a] - m_new)
        p = torch.exp(scores - m_new[..., None])
        l[:a].mul_(alpha).add_(p.sum(dim=-1))
        acc[:a].mul_(alpha[..., None]).add_((p[:, :, :, None, :] * v_tile).sum(dim=-1))
        m[:a] = m_new
    out[order] = acc / l[..., None]
    return out.view(num_tokens_padded, num_q_heads, head_dim).to(q.dtype)
