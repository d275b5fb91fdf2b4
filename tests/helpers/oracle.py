"""transformers as the oracle: greedy tokens from the transformers model, one prompt at a time."""

from __future__ import annotations

import inspect

import torch


def hf_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``model.generate`` greedy, no EOS stop."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_greedy_loop(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The same decision made step by step through the model's own cached forward.

    transformers' ``generate`` adds its own input preparation on top of this; on prompts longer
    than 128 tokens it has been seen to disagree with the model's forward (cached or not), so
    the parity tests check against this loop on every prompt and against ``generate`` where it
    is consistent with the forward.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    # transformers renamed the forward's ``past_key_values`` to ``cache`` (the old name warns)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, use_cache=True, **{name: cache}).logits[0, -1]
            out.append(int(logits.argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


def hf_greedy_uncached(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from the model's full, uncached forward over the whole sequence at every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]
