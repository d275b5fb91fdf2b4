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

# Above this many elements in the all-tiles P@V product (tokens x query heads x keys x head dim) the
# reference goes tile by tile, whatever the shape of the call.
_AT_ONCE_ELEMENTS = 1 << 22


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
    num_tiles = int(pos_sorted[0]) // block_size + 1
    tiles = torch.arange(num_tiles, device=q.device)
    seen = (pos_sorted[None, :] >= tiles[:, None] * block_size).sum(dim=1).tolist()  # tokens seeing tile b
    l = torch.zeros(num_tokens, num_kv_heads, group, device=q.device)
    acc = torch.zeros(num_tokens, num_kv_heads, group, head_dim, device=q.device)
    # The same elementwise work either way, so the same bits (tests/kernels/test_attention.py): every
    # tile's scores, probabilities and P@V at once when most tokens see most tiles (decode and verify
    # steps: a few calls instead of a few per tile), tile by tile otherwise (a prefill: half the work).
    cache = (k_cache, v_cache, block_size)
    if all_tiles_at_once(seen, num_tokens * num_q_heads * block_size * head_dim):
        steps = _all_tiles(q32, cache, pos_sorted, block_table[rows_sorted], seen, scale)
    else:
        steps = _each_tile(q32, cache, pos_sorted, rows_sorted, block_table, seen, scale)
    for a, alpha, p_sum, pv in steps:  # the online-softmax update of the a tokens seeing the tile
        l[:a].mul_(alpha).add_(p_sum)
        acc[:a].mul_(alpha[..., None]).add_(pv)
    out[order] = acc / l[..., None]
    return out.view(num_tokens_padded, num_q_heads, head_dim).to(q.dtype)


def all_tiles_at_once(seen: list[int], elements_per_tile: int) -> bool:
    """Whether to compute every tile at once: three tiles or more (below, the loop costs as little),
    most (token, tile) pairs seen, and the P@V product (``elements_per_tile`` x tiles) under
    ``_AT_ONCE_ELEMENTS``."""
    num_tiles = len(seen)
    return num_tiles >= 3 and 2 * sum(seen) >= seen[0] * num_tiles and \
        elements_per_tile * num_tiles <= _AT_ONCE_ELEMENTS


def _each_tile(q32, cache, pos_sorted, rows_sorted, block_table, seen, scale):
    """Per tile b, for the ``a = seen[b]`` tokens seeing it: ``a``, the rescale factor ``alpha`` of their
    running sums (the running max ``m`` kept here), the sum of their probabilities and their P@V."""
    k_cache, v_cache, block_size = cache
    num_tokens, num_kv_heads, group = q32.shape[:3]
    m = torch.full((num_tokens, num_kv_heads, group), float("-inf"), device=q32.device)
    offsets = torch.arange(block_size, device=q32.device)
    for tile, a in enumerate(seen):  # tile 0 is seen by every token
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
        m[:a] = m_new
        yield a, alpha, p.sum(dim=-1), (p[:, :, :, None, :] * v_tile).sum(dim=-1)


def _all_tiles(q32, cache, pos_sorted, table, seen, scale):
    """``_each_tile``'s values, every tile's computed at once over all tokens: a token's entries for a
    tile it does not see are never read (only the first ``seen[b]`` rows of tile b are handed out)."""
    k_cache, v_cache, block_size = cache
    n, num_kv_heads, group, _, head_dim = q32.shape
    num_tiles = len(seen)
    tiles = torch.arange(num_tiles, device=q32.device)
    visible = tiles[None, :] * block_size <= pos_sorted[:, None]  # [n, NT]
    blocks = torch.where(visible, table[:, :num_tiles].long(), 0)  # a tile not seen may have no block
    key_pos = (tiles[:, None] * block_size + torch.arange(block_size, device=q32.device)).reshape(-1)
    hidden = key_pos[None, :] > pos_sorted[:, None]  # [n, NT * block_size]
    keys = k_cache[blocks].float().view(n, num_tiles * block_size, num_kv_heads, head_dim)
    keys = keys.permute(0, 2, 1, 3).unsqueeze(2)  # [n, Hkv, 1, NT * block_size, D]
    values = v_cache[blocks].float().view(n, num_tiles * block_size, num_kv_heads, head_dim)
    values = values.masked_fill_(hidden[:, :, None, None], 0.0).view(n, num_tiles, block_size, num_kv_heads,
                                                                      head_dim)
    values = values.permute(0, 3, 1, 4, 2).contiguous().unsqueeze(2)  # [n, Hkv, 1, NT, D, block_size]
    scores = (q32 * keys).sum(dim=-1) * scale  # [n, Hkv, G, NT * block_size]
    scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    scores = scores.view(n, num_kv_heads, group, num_tiles, block_size)
    running = torch.cummax(scores.amax(dim=-1), dim=-1).values  # [n, Hkv, G, NT]: the max after tile b
    before = torch.cat([torch.full_like(running[..., :1], float("-inf")), running[..., :-1]], dim=-1)
    alpha = torch.exp(before - running)
    p = torch.exp(scores - running[..., None])
    p_sum = p.sum(dim=-1)  # [n, Hkv, G, NT]
    pv = (p[:, :, :, :, None, :] * values).sum(dim=-1)  # [n, Hkv, G, NT, D]
    for tile, a in enumerate(seen):
        yield a, alpha[:a, :, :, tile], p_sum[:a, :, :, tile], pv[:a, :, :, tile]
