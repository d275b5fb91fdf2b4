"""The logits processors and logprobs of the async engine: ``refengine.logits_process`` batched on the
device, keyed by request slot.

Each request's processors live in ``ProcessorState`` rows (the slot's allowed-id mask, bias, stop ids
``min_tokens`` holds back, penalty factors, prompt mask, output counts, bad words). Every admission
(new, resumed, on a reused slot) rewrites all of its slot's rows from the staged writes
(``staged_writes``), so nothing of a slot's previous owner survives. The output counts advance in
the program's commit stage with the kept tokens only (``advance``). ``apply`` processes every logits
row of a step: row r's position j sees the slot's committed outputs extended by the row's drafts
0..j-1, so a verify window is processed as if decoded one token at a time. It reads only the row
table, the state and the step's padded sizes, so a FULL step captures it; a request with no
processors has neutral rows (everything allowed, no bias, factors 1/0/0), which leave its argmax as
it was.
"""

from __future__ import annotations

import torch

from refengine.logits_process import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, Processors, top_logprobs

WILDCARD = -2  # a bad word's prefix slot that matches anything (left of a short prefix)


class ProcessorState:
    """Per-slot processor rows, ``R`` slots (the sink row included) over a ``V``-id vocabulary."""

    def __init__(self, num_slots: int, vocab_size: int, device):
        r, v, w, lp = num_slots, vocab_size, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS - 1
        self.vocab_size = v
        self.allowed = torch.ones(r, v, dtype=torch.bool, device=device)  # [R, V] ids that may be chosen
        self.bias = torch.zeros(r, v, dtype=torch.float32, device=device)  # [R, V] logit bias
        self.stop_mask = torch.zeros(r, v, dtype=torch.bool, device=device)  # [R, V] ids min_tokens holds
        self.min_tokens = torch.zeros(r, dtype=torch.int64, device=device)  # [R]
        self.factors = torch.tensor([1.0, 0.0, 0.0], device=device).repeat(r, 1)  # [R, 3] rep, freq, presence
        self.prompt_mask = torch.zeros(r, v, dtype=torch.bool, device=device)  # [R, V] ids in the prompt
        self.output_counts = torch.zeros(r, v, dtype=torch.int32, device=device)  # [R, V] committed outputs
        # bad words: prefix right-aligned (WILDCARD left of it), prefix length (-1: no word), last token
        self.bad_prefix = torch.full((r, w, lp), WILDCARD, dtype=torch.int64, device=device)  # [R, W, L-1]
        self.bad_prefix_len = torch.full((r, w), -1, dtype=torch.int64, device=device)  # [R, W]
        self.bad_last = torch.zeros(r, w, dtype=torch.int64, device=device)  # [R, W]

    # ---- admission ---------------------------------------------------------------------------------
    @staticmethod
    def staged_writes(w, processors: list[Processors]) -> None:
        """Add the admitted requests' processor rows to the staged writes ``w`` (host, one per request, in
        admission order; every row is written, a request without processors gets neutral ones)."""
        n, lp = len(processors), MAX_BAD_WORD_TOKENS - 1
        allowed, bias, stop = [], [], []
        prefix = torch.full((n, MAX_BAD_WORDS, lp), WILDCARD, dtype=torch.int64)
        prefix_len = torch.full((n, MAX_BAD_WORDS), -1, dtype=torch.int64)
        last = torch.zeros(n, MAX_BAD_WORDS, dtype=torch.int64)
        for i, p in enumerate(processors):
            allowed += [(i, t) for t in p.allowed_token_ids or ()]
            bias += [(i, t, b) for t, b in p.logit_bias]
            stop += [(i, t) for t in p.min_tokens_stop_ids]
            for k, word in enumerate(p.bad_words_ids):
                pre = list(word[:-1])
                if pre:
                    prefix[i, k, lp - len(pre):] = torch.tensor(pre)
                prefix_len[i, k], last[i, k] = len(pre), word[-1]
        factors = torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
                                for p in processors], dtype=torch.float32)
        w.add("proc.restricted", torch.tensor([p.allowed_token_ids is not None for p in processors]))  # [n]
        w.add("proc.allowed", torch.tensor(allowed, dtype=torch.int64).reshape(-1, 2))  # [a, 2] (row, id)
        w.add("proc.bias.at", torch.tensor([(i, t) for i, t, _ in bias], dtype=torch.int64).reshape(-1, 2))
        w.add("proc.bias", torch.tensor([b for _, _, b in bias], dtype=torch.float32))  # [b]
        w.add("proc.stop", torch.tensor(stop, dtype=torch.int64).reshape(-1, 2))  # [s, 2] (row, id)
        w.add("proc.min_tokens", torch.tensor([p.min_tokens for p in processors]))  # [n]
        w.add("proc.factors", factors)  # [n, 3] float32
        w.add("proc.bad_prefix", prefix)  # [n, W, L-1]
        w.add("proc.bad_prefix_len", prefix_len)  # [n, W]
        w.add("proc.bad_last", last)  # [n, W]

    def admit(self, idx: torch.Tensor, w: dict, token_rows: torch.Tensor, num_tokens: torch.Tensor,
              num_prompt: torch.Tensor) -> None:
        """Rewrite the admitted slots' rows (device timeline): ``w`` the unpacked staged writes,
        ``token_rows`` [n, L] their committed tokens (prompt, then outputs of a resumed request)."""
        idx, v = idx.long(), self.vocab_size
        self.allowed[idx] = (w["proc.restricted"] == 0)[:, None].expand(-1, v)
        # the sparse writes' sizes are the staged tensors' shapes (host metadata): an empty one is skipped
        a = w["proc.allowed"]
        if a.shape[0]:
            self.allowed[idx[a[:, 0]], a[:, 1]] = True
        self.bias[idx] = 0.0
        at = w["proc.bias.at"]
        if at.shape[0]:
            self.bias[idx[at[:, 0]], at[:, 1]] = w["proc.bias"]
        self.stop_mask[idx] = False
        s = w["proc.stop"]
        if s.shape[0]:
            self.stop_mask[idx[s[:, 0]], s[:, 1]] = True
        self.min_tokens[idx] = w["proc.min_tokens"]
        self.factors[idx] = w["proc.factors"]
        self.bad_prefix[idx] = w["proc.bad_prefix"]
        self.bad_prefix_len[idx] = w["proc.bad_prefix_len"]
        self.bad_last[idx] = w["proc.bad_last"]
        pos = torch.arange(token_rows.shape[1], device=token_rows.device)[None, :]
        tok = token_rows.clamp(min=0)
        in_prompt = pos < num_prompt.long()[:, None]
        in_output = ~in_prompt & (pos < num_tokens.long()[:, None])
        zeros = torch.zeros(idx.shape[0], v, dtype=torch.int32, device=idx.device)
        self.prompt_mask[idx] = zeros.scatter_add(1, tok, in_prompt.to(torch.int32)) > 0
        self.output_counts[idx] = zeros.scatter_add(1, tok, in_output.to(torch.int32))

    # ---- the step program ------------------------------------------------------------------------------
    def advance(self, idx: torch.Tensor, sampled: torch.Tensor) -> None:
        """Commit stage: count each row's kept tokens (``sampled`` [Np, K+1], -1 past them) into its slot."""
        keep = sampled >= 0
        slots = idx.long()[:, None].expand_as(sampled)
        self.output_counts.index_put_((slots, sampled.clamp(min=0)), keep.to(torch.int32), accumulate=True)

    def apply(self, logits: torch.Tensor, slot: torch.Tensor, row: torch.Tensor, j: torch.Tensor,
              num_outputs: torch.Tensor, drafts: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """The processed copy of ``logits`` [M, V]. Logits row m is position ``j[m]`` of padded row
        ``row[m]`` whose request slot is ``slot[m]``; ``num_outputs`` [M] its request's committed outputs;
        ``drafts`` [Np, K] each row's drafts; ``tail`` [Np, L-1] each row's last committed tokens."""
        x = logits.to(torch.float32)
        neg = torch.full_like(x, float("-inf"))
        x = torch.where(self.allowed[slot], x, neg)  # 1
        x = x + self.bias[slot]  # 2
        decoded = num_outputs + j  # outputs before the position, drafts before it in the window included
        held = (decoded < self.min_tokens[slot])[:, None] & self.stop_mask[slot]
        x = torch.where(held, neg, x)  # 3
        np_, k = drafts.shape
        v = x.shape[1]
        # [Np, K+1, V] the drafts before each position, counted
        before = torch.zeros(np_, k + 1, v, dtype=torch.int32, device=x.device)
        if k:
            hot = torch.zeros(np_, k, v, dtype=torch.int32, device=x.device)
            hot.scatter_(2, drafts[:, :, None], 1)
            before[:, 1:] = hot.cumsum(1, dtype=torch.int32)
        counts = self.output_counts[slot] + before[row, j]  # [M, V]
        seen = self.prompt_mask[slot] | (counts > 0)
        rep, freq, pres = self.factors[slot].unbind(1)
        x = torch.where(seen, torch.where(x > 0, x / rep[:, None], x * rep[:, None]), x)  # 4
        x = x - freq[:, None] * counts.to(torch.float32)
        x = x - pres[:, None] * (counts > 0).to(torch.float32)
        lp = tail.shape[1]  # 5: the L-1 tokens before each position (outputs, then drafts before it)
        history = torch.cat([tail, drafts], dim=1)  # [Np, L-1+K]
        window = history[row[:, None], j[:, None] + torch.arange(lp, device=x.device)[None, :]]  # [M, L-1]
        prefix = self.bad_prefix[slot]  # [M, W, L-1]
        plen = self.bad_prefix_len[slot]  # [M, W]
        match = ((prefix == window[:, None, :]) | (prefix == WILDCARD)).all(-1)
        match &= (plen >= 0) & (plen <= decoded[:, None])
        banned = torch.zeros(x.shape, dtype=torch.int32, device=x.device)
        banned.scatter_add_(1, self.bad_last[slot], match.to(torch.int32))
        return torch.where(banned > 0, neg, x)


def logprob_tables(logits: torch.Tensor, cu: torch.Tensor, tokens: torch.Tensor):
    """Raw logprobs of each padded row's positions (``cu`` [Np+1] its logits rows, ``tokens`` [Np, K+1] its
    kept tokens then -1): (top values [Np, K+1, N], top ids [Np, K+1, N], the kept token's [Np, K+1])."""
    raw = torch.log_softmax(logits.to(torch.float32), dim=-1)
    values, ids = top_logprobs(raw)
    m, width = raw.shape[0], tokens.shape[1]
    at = (cu[:-1, None] + torch.arange(width, device=cu.device)[None, :]).clamp(max=m - 1)
    return values[at], ids[at], raw[at, tokens.clamp(min=0)]
