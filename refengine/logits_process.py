"""The logits processors of a request, in vLLM 0.33's order: the one written definition.

A request's ``SamplingParams`` are resolved once, at admission, into ``Processors`` (token ids only:
bad words encoded, the stop ids ``min_tokens`` holds back). ``process`` applies them to the logits
of one position, given the tokens decoded before it, in this order (vLLM 0.33's sampler pipeline:
"bias adds, penalties scale, so the two do not commute"):

    1. allowed_token_ids   every other id -> -inf
    2. logit_bias          bias[id] added
    3. min_tokens          while fewer than min_tokens outputs exist: every stop id (stop_token_ids and
                           the model's EOS ids, whatever ignore_eos says) -> -inf
    4. penalties           repetition: ids in the prompt or the output have a positive logit divided
                           by the penalty, a non-positive one multiplied; then frequency (times the
                           id's count in the output) and presence (once if in the output) subtracted
    5. bad_words           a word whose every token but the last ends the output: its last token -> -inf
                           (only output tokens count as the prefix, as vLLM's)

Greedy decoding picks the argmax of the processed logits (lowest id on ties). Logprobs are never
processed: they are the raw log-softmax of the target's logits (vLLM's default ``raw_logprobs``).

Under speculation each verify position j of a row is processed with the output extended by the
row's drafts 0..j-1, as if they had been decoded one at a time (penalty counts, bad-word prefixes,
the ``min_tokens`` count). The reference runner calls ``process`` per position with plain lists;
the async engine computes the same thing batched on the device (``refengine.async_engine.processing``),
with the same elementwise arithmetic, so the argmax agrees exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refengine.sampling_params import SamplingParams

MAX_BAD_WORDS = 16  # encoded bad words (with their prefix-space forms) per request
MAX_BAD_WORD_TOKENS = 8  # tokens per encoded bad word
MAX_LOGPROBS = 20  # top-n logprobs a request may ask for (vLLM's default max_logprobs)


@dataclass(frozen=True)
class Processors:
    """One request's processors, as token ids (``resolve``)."""

    allowed_token_ids: tuple[int, ...] | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_tokens_stop_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.allowed_token_ids or self.logit_bias
                    or (self.min_tokens and self.min_tokens_stop_ids)
                    or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.bad_words_ids)


NONE = Processors()


def encode_bad_words(words, tokenizer) -> list[list[int]]:
    """vLLM's encoding: each word without and with a leading space (stripped first); the spaced form is
    kept when it starts with another token and has as many tokens as the plain one."""
    out: list[list[int]] = []
    for word in words:
        for spaced in (False, True):
            ids = list(tokenizer.hf.encode(("" if not spaced else " ") + word.lstrip(),
                                           add_special_tokens=False))
            if not ids:
                if not spaced:
                    raise ValueError(f"bad_words entry {word!r} encodes to no token")
                continue
            if not spaced or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return out


def resolve(params: SamplingParams, vocab_size: int, eos_token_ids, tokenizer) -> Processors:
    """``params`` as token ids; ValueError naming the field for an id outside the vocabulary, a bad word
    or stop string without a tokenizer, or more than the engines hold."""
    def check_ids(name: str, ids) -> None:
        for t in ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"{name}: {t} is not an id in [0, {vocab_size})")

    if params.allowed_token_ids is not None:
        check_ids("allowed_token_ids", params.allowed_token_ids)
    bias = tuple(sorted((params.logit_bias or {}).items()))
    check_ids("logit_bias", [t for t, _ in bias])
    bad: list[list[int]] = []
    if params.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this checkpoint has none")
        bad = encode_bad_words(params.bad_words, tokenizer)
        check_ids("bad_words", [t for ids in bad for t in ids])
        if len(bad) > MAX_BAD_WORDS or any(len(ids) > MAX_BAD_WORD_TOKENS for ids in bad):
            raise ValueError(f"bad_words: at most {MAX_BAD_WORDS} encoded words of at most "
                             f"{MAX_BAD_WORD_TOKENS} tokens each, got {[len(ids) for ids in bad]}")
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer; this checkpoint has none")
    if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
        raise ValueError(f"logprobs must be <= {MAX_LOGPROBS}, got {params.logprobs}")
    if params.prompt_logprobs is not None and params.prompt_logprobs > MAX_LOGPROBS:
        raise ValueError(f"prompt_logprobs must be <= {MAX_LOGPROBS}, got {params.prompt_logprobs}")
    stop_ids = tuple(sorted(set(params.stop_token_ids) | set(eos_token_ids)))
    return Processors(
        allowed_token_ids=tuple(sorted(set(params.allowed_token_ids))) if params.allowed_token_ids else None,
        logit_bias=bias,
        min_tokens=params.min_tokens,
        min_tokens_stop_ids=stop_ids if params.min_tokens else (),
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        bad_words_ids=tuple(tuple(ids) for ids in bad),
    )


def process(logits: torch.Tensor, p: Processors, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The processed copy of one position's ``logits`` [V] float32; ``output``: the tokens decoded
    before this position (committed outputs, then the drafts before it in its verify window)."""
    x = logits.clone()
    if not p.active:
        return x
    vocab = x.shape[0]
    if p.allowed_token_ids is not None:  # 1
        allowed = torch.zeros(vocab, dtype=torch.bool, device=x.device)
        allowed[list(p.allowed_token_ids)] = True
        x = torch.where(allowed, x, torch.full_like(x, float("-inf")))
    if p.logit_bias:  # 2
        bias = torch.zeros(vocab, dtype=torch.float32, device=x.device)
        for t, b in p.logit_bias:
            bias[t] = b
        x = x + bias
    if len(output) < p.min_tokens:  # 3
        for t in p.min_tokens_stop_ids:
            x[t] = float("-inf")
    if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:  # 4
        counts = torch.zeros(vocab, dtype=torch.int32, device=x.device)
        for t in output:
            counts[t] += 1
        seen = torch.zeros(vocab, dtype=torch.bool, device=x.device)
        seen[list(prompt)] = True
        seen |= counts > 0
        rep = torch.full_like(x, p.repetition_penalty)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - torch.full_like(x, p.frequency_penalty) * counts.to(torch.float32)
        x = x - torch.full_like(x, p.presence_penalty) * (counts > 0).to(torch.float32)
    for word in p.bad_words_ids:  # 5
        prefix = list(word[:-1])
        if len(prefix) <= len(output) and (not prefix or output[-len(prefix):] == prefix):
            x[word[-1]] = float("-inf")
    return x


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[M, V] float32 log-softmax of the target's logits (never processed)."""
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


def top_logprobs(logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``MAX_LOGPROBS`` best (values, ids) of each row of ``logprobs`` [M, V]: both engines take a
    request's top-n as the first n of these, so ties fall the same way."""
    return torch.topk(logprobs, min(MAX_LOGPROBS, logprobs.shape[-1]), dim=-1)


def prompt_logprob_span(req, num_computed: int, num_tokens: int) -> tuple[int, int] | None:
    """The prompt logprobs a prefill chunk at positions ``num_computed`` .. ``+ num_tokens`` yields, as
    (index of the first prompt token they are for, how many); None when it yields none.

    vLLM's meaning: position p's logits give the logprob of prompt token p + 1, so a chunk yields one per
    position up to the prompt's last token; a chunk's last position is for the next chunk's first token
    (vLLM #41411 lost it). A request whose prompt logprobs are complete (a readmission after preemption)
    asks for none; entries a readmission computes again are dropped by the post-step writer.
    """
    done = req.prompt_logprobs
    if done is None or len(done) >= len(req.prompt_token_ids):
        return None
    count = min(num_tokens, len(req.prompt_token_ids) - 1 - num_computed)
    return (num_computed + 1, count) if count > 0 else None


def logprob_dict(top_values: list[float], top_ids: list[int], token: int, token_logprob: float,
                 n: int) -> dict[int, float]:
    """One output token's entry: the top-``n`` ids, then the chosen ``token`` (always present)."""
    out = dict(zip(top_ids[:n], top_values[:n]))
    out[token] = token_logprob
    return out
