"""Plain-torch references for the causal depthwise conv1d with a pooled conv state.

Both forms build ``full = concat(window_in, x_row)`` (``[C, W-1+L]``) and compute, in float32,
``out[t] = act(bias + sum_j weight[:, j] * full[:, t + j])`` (no bias term without a bias) with the
taps summed in the order ``j = 0..W-1`` after the bias, by elementwise ops only, so the prefill and
update forms give bitwise equal outputs for the same window and every row is independent of its neighbours.
"""

from __future__ import annotations

import torch

from kernels.constants import PAD_SLOT_ID
from kernels.conv1d.contract import check_conv1d_fn_inputs, check_conv1d_update_inputs


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` written as ``x / (1 + exp(-x))``.

    ``torch.sigmoid`` / ``F.silu`` on CPU can round the vectorised body and the scalar tail of a
    tensor differently, which would make a value depend on its position in the batch; ``exp``,
    ``+`` and ``/`` give the same result wherever the element sits.
    """
    return x / (1.0 + torch.exp(-x))


def conv_window(full: torch.Tensor, weight: torch.Tensor, activation: str | None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``full [..., C, W-1+L]`` float32, ``weight [C, W]`` float32, ``bias [C]`` float32 or None ->
    ``[..., C, L]`` float32; the sum starts from the bias, then the taps in order."""
    width = weight.shape[1]
    length = full.shape[-1] - (width - 1)
    acc = weight[:, 0:1] * full[..., 0:length]
    if bias is not None:
        acc = bias[:, None] + acc
    for j in range(1, width):
        acc = acc + weight[:, j:j + 1] * full[..., j:j + length]
    if activation == "silu":
        return silu(acc)
    assert activation is None, f"activation must be 'silu' or None, got {activation!r}"
    return acc


def naive_causal_conv1d_fn(x, weight, conv_state, cu_seqlens, state_indices, has_initial_state, *,
                           bias=None, activation="silu"):
    """Prefill form (``bias [C]`` or None starts each output's sum):
    ``window_in = conv_state[s, :, 0:W-1]`` (zeros without initial state); afterwards
    ``conv_state[s, :, 0:W-1] = full[:, -(W-1):]``. Rows of length 0 and rows whose slot is
    PAD_SLOT_ID read and write nothing (zero outputs)."""
    check_conv1d_fn_inputs(x, weight, conv_state, cu_seqlens, state_indices, has_initial_state, activation,
                           bias)
    num_tokens, channels = x.shape
    width = weight.shape[1]
    w32 = weight.float()
    b32 = None if bias is None else bias.float()
    cu = cu_seqlens.tolist()
    slots = state_indices.tolist()
    init = [True] * len(slots) if has_initial_state is None else has_initial_state.tolist()
    out = torch.zeros(num_tokens, channels, dtype=x.dtype, device=x.device)
    for i, slot in enumerate(slots):
        bos, eos = cu[i], cu[i + 1]
        if eos == bos or slot == PAD_SLOT_ID:
            continue
        if init[i]:
            window = conv_state[slot, :, 0:width - 1].float()
        else:
            window = torch.zeros(channels, width - 1, dtype=torch.float32, device=x.device)
        full = torch.cat([window, x[bos:eos].float().t()], dim=1)
        out[bos:eos] = conv_window(full, w32, activation, b32).t().to(x.dtype)
        conv_state[slot, :, 0:width - 1] = full[:, -(width - 1):].to(conv_state.dtype)
    return out


def naive_causal_conv1d_update(x, weight, conv_state, query_start_loc, state_indices, *,
                               num_valid=None, bias=None, activation="silu"):
    """Decode / verify form: with ``a = num_valid[i]`` (1 when None),
    ``window_in = conv_state[s, :, a-1 : a-1+W-1]``; afterwards
    ``conv_state[s, :, 0 : W-2+L] = full[:, 1:]``. All rows are processed together: they are
    padded to the longest row and only elementwise ops run across them."""
    check_conv1d_update_inputs(x, weight, conv_state, query_start_loc, state_indices, num_valid,
                               activation, bias)
    num_tokens, channels = x.shape
    width = weight.shape[1]
    state_len = conv_state.shape[2]
    cu = query_start_loc.tolist()
    col0 = (state_indices if state_indices.dim() == 1 else state_indices[:, 0]).tolist()
    accepted = [1] * len(col0) if num_valid is None else num_valid.tolist()
    rows = [i for i in range(len(col0)) if col0[i] != PAD_SLOT_ID and cu[i + 1] > cu[i]]
    out = torch.zeros(num_tokens, channels, dtype=x.dtype, device=x.device)
    if not rows:
        return out
    lens = [cu[i + 1] - cu[i] for i in rows]
    longest = max(lens)
    for i, length in zip(rows, lens):
        assert 1 <= accepted[i] and accepted[i] - 1 + width - 1 <= state_len, (
            f"row {i}: num_valid {accepted[i]} does not fit a conv state of {state_len} columns")
        assert width - 2 + length <= state_len, f"row {i}: {length} tokens do not fit the conv state"
    dev = x.device
    slot_list = [col0[i] for i in rows]
    slots = torch.tensor(slot_list, dtype=torch.long, device=dev)
    # Window columns a-1 .. a-1+W-2 of each row's slot, read before anything is written.
    picked = conv_state.index_select(0, slots)                                        # [R, C, state_len]
    firsts = [accepted[i] - 1 for i in rows]
    if len(set(firsts)) == 1:  # every row starts at the same column (always so for decodes)
        window = picked[:, :, firsts[0]:firsts[0] + width - 1]
    else:
        first = torch.tensor(firsts, device=dev)
        win_cols = first[:, None, None] + torch.arange(width - 1, device=dev)[None, None, :]  # [R, 1, W-1]
        window = torch.gather(picked, 2, win_cols.expand(len(rows), channels, width - 1))
    # Tokens of each row, padded to the longest row with a valid index whose results are dropped.
    offs = torch.arange(longest, device=dev)
    tok = torch.tensor([cu[i] for i in rows], device=dev)[:, None] + offs[None, :]   # [R, Lmax]
    uniform = min(lens) == longest
    if uniform:
        xs = x[tok].float()                                                          # [R, Lmax, C]
    else:
        valid = offs[None, :] < torch.tensor(lens, device=dev)[:, None]           # [R, Lmax]
        tok = torch.where(valid, tok, 0)
        xs = torch.where(valid[:, :, None], x[tok].float(), 0.0)
    full = torch.cat([window.float(), xs.transpose(1, 2)], dim=2)                   # [R, C, W-1+Lmax]
    b32 = None if bias is None else bias.float()
    res = conv_window(full, weight.float(), activation, b32).transpose(1, 2)            # [R, Lmax, C]
    if uniform:
        out[tok.reshape(-1)] = res.reshape(-1, channels).to(x.dtype)
    else:
        out[tok[valid]] = res[valid].to(x.dtype)
    if uniform and len(set(slot_list)) == len(slot_list):  # one write for all rows (distinct slots)
        conv_state[slots, :, 0:width - 2 + longest] = full[:, :, 1:width - 1 + longest].to(conv_state.dtype)
    else:  # row by row, in row order (a repeated slot keeps the later row's state)
        for r, (slot, length) in enumerate(zip(slot_list, lens)):
            conv_state[slot, :, 0:width - 2 + length] = full[r, :, 1:width - 1 + length].to(conv_state.dtype)
    return out
