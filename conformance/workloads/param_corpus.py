"""Scenarios whose requests carry state: logits processors, stop strings and logprobs (issue 34).

One batch mixes requests with parameters and without (an unrestricted request beside restricted ones,
and admitted onto the seat a restricted one just left), three seats so rows move between steps, and the
scripted drafter proposes each request's own processed continuation, so acceptance does not depend on
the model. Every parameter must change the reference's output ("params-change-output"). Ids are drawn
per scenario, so the same scenario runs on any vocabulary; the triggers are tuned to the embedded
default model (byte-level tokenizer: the stop-string scenarios need a tokenizer, the others do not).
"""

from __future__ import annotations

from conformance.workloads.scenario import TIERS, EngineSettings, ScenarioDef

NIGHTLY = ("nightly",)
# Why a stop-string trigger is the checkpoint's: the scenario reads ids 97-99 and 32 as "a"-"c" and a
# space, one token per byte; forced where the tokenizer is byte-level, whatever the weights.
BYTES = ("the allowed ids are taken for the letters of a byte-level tokenizer (one token per byte); "
         "another tokenizer spells other text with them")


def _ids(b, n: int) -> list[int]:
    return sorted(b.rng.sample(range(b.vocab_size), n))


def _processors(b, k: int) -> None:
    """The id-only processors side by side (no tokenizer needed)."""
    v = b.vocab_size
    stops = tuple(_ids(b, v // 3))
    n = b.size(10, 40)
    b.add(9, n)  # unrestricted, beside the others
    b.add(7, n, params={"allowed_token_ids": _ids(b, v // 5), "logprobs": 2})
    # over four allowed ids the output repeats on any model, so the penalties always decide something (the
    # ids are taken from the vocabulary size, not drawn, so the scenario's other draws stay as they were)
    b.add(12, n, repeat=3, params={"repetition_penalty": 1.7, "frequency_penalty": 0.6, "logprobs": 1,
                                   "allowed_token_ids": sorted({v // 7, v // 5, v // 3, v // 2})})
    # min_tokens requests that stop exactly where min_tokens lets them, on any model: one free id and two stop
    # ids allowed, the stop ids biased far above it, so min_tokens alone holds the stop back until then
    held = stops[:2]
    free = min(set(range(v)) - set(stops))
    forced = {"allowed_token_ids": sorted({free, *held}), "logit_bias": {t: 50.0 for t in held}}
    # every id but the free one stops them, so the model's raw argmax at a position min_tokens covers is a
    # stop id it holds back unless the model picks that one id there ("stop-held-in-window")
    most = tuple(t for t in range(v) if t != free)
    b.add(5, n, ignore_eos=False, stop_token_ids=most, params={"min_tokens": 5, "logprobs": 1, **forced})
    b.add(10, n, params={"logit_bias": {t: 6.0 for t in _ids(b, 3)}, "presence_penalty": 1.5})
    b.add(6, n, arrival=2)  # unrestricted, onto a seat a restricted request leaves
    for m in (2, 3, 4):  # min_tokens ending at each later position of a verify window
        b.add(6 + m, m + 4, arrival=1 + m, ignore_eos=False, stop_token_ids=most,
              params={"min_tokens": m, "logprobs": 1, **forced})
    b.add(11, n, arrival=4, params={"allowed_token_ids": _ids(b, v // 2)})
    b.add(14, n + 4, arrival=5, repeat=2, params={"frequency_penalty": 0.5, "presence_penalty": 0.2})
    for i in range(b.size(0, 6)):
        b.add(b.rng.randint(3, 20), n, arrival=6 + i, params={} if i % 2 else
              {"repetition_penalty": 1.3, "allowed_token_ids": _ids(b, v // 4), "logprobs": 3})
    # prompt logprobs over a prompt longer than the step's budget: prefilled in two chunks or more
    b.add(276, 3, arrival=12, params={"prompt_logprobs": 2})  # 256: the scenario's token budget


def _params_mixed(k: int, pattern: str = "hash", tiers=TIERS) -> ScenarioDef:
    return ScenarioDef(
        f"params-mixed-k{k}",
        f"allowed ids, logit bias, min_tokens, the three penalties, logprobs and prompt logprobs (a prompt "
        f"prefilled in chunks) in one batch of three seats "
        f"with unrestricted requests beside and after them (scripted drafter, K={k})",
        EngineSettings(num_speculative_tokens=k, drafter="scripted", pattern=pattern, max_num_seqs=3),
        lambda b: _processors(b, k),
        ("unrestricted-beside-restricted", "params-rows-reordered", "slot-reused-unrestricted",
         "penalties-over-drafts", "logprobs-in-window", "min-tokens-end-in-window",
         "stop-held-in-window", "prompt-logprobs-chunked") if k else
        ("unrestricted-beside-restricted", "params-rows-reordered", "slot-reused-unrestricted"),
        tiers,
        model_decides=(
            ("min-tokens-end-in-window", ("the stop ids' bias of 50 beats the free id's raw logit unless the "
             "model's logits spread wider")),
            ("stop-held-in-window", ("the model's raw argmax may be the one id that is no stop at every "
             "later window position min_tokens covers")),
        ) if k else (),
    )


def _text(b, k: int) -> None:
    """Stop strings and bad words over a small alphabet (allowed ids: bytes of the letters), so the strings
    come up; one prompt with max_tokens 2 and 3 so that one of them completes its stop string at the cap.

    The unrestricted r07 takes a seat a restricted request left ("slot-reused-unrestricted") whatever the
    model: r01-r06 all carry parameters, and r00, the one unrestricted request ahead of it, is done by
    step 2 (9 tokens: the prefill's and two all-accept windows of K+1). r07 (7th in the queue, 3 seats)
    needs five of r00-r06 finished first, and r03 (no stop: 1 + ceil((n - 1) / 4) steps), r05 and r06
    (arriving at step 2) finish at step 3 at the earliest, so it is admitted at a step s >= 4; a seat free
    at s that was not at s - 1 was left by a request finishing at s - 1 >= 3, one of r01-r06."""
    letters = [ord(c) for c in "abc "]
    n = b.size(16, 40)
    b.add(6, 9)  # unrestricted, beside the others; done by step 2 (see above)
    b.add(7, n, params={"allowed_token_ids": letters[:2], "stop": ["bab", "aaa"], "logprobs": 1})
    b.add(9, n, params={"allowed_token_ids": letters, "stop": ["c a", "bb"],
                        "include_stop_str_in_output": True})
    b.add(8, n, params={"allowed_token_ids": letters, "bad_words": ["a", "cb"], "logprobs": 2})
    # held to the one id of "e": its first token, the prefill's, completes the kept stop string "e" on any
    # model (left free, the text of the tiny checkpoints never held an "e", so the stop changed nothing)
    b.add(5, n, arrival=1, params={"allowed_token_ids": [ord("e")], "stop": ["e"],
                                   "include_stop_str_in_output": True, "logprobs": 0})
    shared = b.prompt(6)
    for m in (2, 3):
        b.add_ids(shared, m, arrival=2, params={"allowed_token_ids": letters[:2], "stop": ["ab"]})
    b.add(10, n, arrival=3)  # unrestricted, onto a seat a restricted request leaves (forced: see above)
    # Requests held to the one id of "a": "aaa" completes at the third token, inside the first verify window
    # (all-accept) and across it and the prefill's; "aa" at max_tokens 2. Whatever the model, where ids are
    # bytes (the byte-level tokenizer).
    only_a = {"allowed_token_ids": letters[:1]}
    b.add(5, n, arrival=4, params={**only_a, "stop": ["aaa"]})
    b.add(6, 2, arrival=4, params={**only_a, "stop": ["aa"]})


def _params_text(k: int, pattern: str = "all-accept", tiers=TIERS) -> ScenarioDef:
    return ScenarioDef(
        f"params-stop-strings-k{k}",
        f"stop strings (kept or not), bad words and logprobs over a small allowed alphabet, one stop string "
        f"completed at max_tokens, three seats (scripted drafter, {pattern}, K={k}; needs a tokenizer)",
        EngineSettings(num_speculative_tokens=k, drafter="scripted", pattern=pattern, max_num_seqs=3),
        lambda b: _text(b, k),
        ("stop-string-in-window", "stop-string-across-windows", "stop-string-at-length",
         "unrestricted-beside-restricted", "slot-reused-unrestricted"),
        tiers,
        model_decides=tuple((t, BYTES) for t in ("stop-string-in-window", "stop-string-across-windows",
                                                 "stop-string-at-length")),
    )


NGRAM_MAX_LEN = 96  # params-ngram-k3's max_model_len: above every other request's prompt and output (10 + 73)


def _ngram(b, k: int) -> None:
    """Penalised requests over two allowed ids (the frequency penalty picks between them, so their output
    cycles and the n-gram drafter finds drafts there, and each verify position's counts decide its token)
    beside unrestricted requests whose random output gives it none; four seats, requests finishing at
    different lengths so rows move. Then one request held to one id, whose drafts are forced."""
    n = b.size(14, 40)
    for i in range(b.size(6, 12)):
        if i % 2:
            b.add(8, n + 3 * i, arrival=i // 2,
                  params={"allowed_token_ids": _ids(b, 2), "frequency_penalty": 0.3 + 0.1 * i})
        else:
            b.add(10, n - i, arrival=i // 2)  # unrestricted: rows without drafts
    _forced_ngram_transitions(b)


def _forced_ngram_transitions(b) -> None:
    """A request whose every output is one id ``t`` (``allowed_token_ids``: the model has no say) and whose
    prompt never holds ``t``. The 2..3-gram lookup (longest n-gram, earliest match, at most K=3 drafts, none
    past ``max_model_len - 1`` committed tokens) then proposes, at N committed tokens (prompt length p):
    N=p+1 and p+2 none (no 2-gram of ``t`` yet); p+3 one (``t t`` after its first copy), accepted, so 2
    tokens more; p+5 two (``t t t`` matched at p); p+8 three; p+12 none, as p+12 = max_model_len - 1. So a
    verify step without drafts right after one that accepted 3 (vLLM #52942), and steps with fewer drafts
    than K, whatever the model."""
    t = b.rng.randrange(b.vocab_size)
    others = [i for i in range(b.vocab_size) if i != t]
    prompt = tuple(b.rng.choice(others) for _ in range(NGRAM_MAX_LEN - 13))
    b.add_ids(prompt, 16, arrival=b.size(3, 6), params={"allowed_token_ids": [t]})


def _params_ngram(k: int, tiers=TIERS) -> ScenarioDef:
    return ScenarioDef(
        f"params-ngram-k{k}",
        f"penalised requests with drafts beside rows without any, rows moving between steps, and one held "
        f"to one id by allowed_token_ids that verifies none at max_model_len {NGRAM_MAX_LEN} - 1 right after "
        f"accepting 3, on any model (n-gram drafter, K={k})",
        EngineSettings(num_speculative_tokens=k, drafter="ngram", prompt_lookup_min=2, prompt_lookup_max=3,
                       max_num_seqs=4, max_model_len=NGRAM_MAX_LEN),
        lambda b: _ngram(b, k),
        ("params-rows-reordered", "penalties-over-drafts", "zero-draft-beside-drafts",
         "zero-draft-after-accept", "partial-drafts"),
        tiers,
        model_decides=(
            ("penalties-over-drafts", ("whether the penalised text over two ids repeats so that the lookup "
             "drafts inside it, and the model keeps two of them, is the model's")),
            ("zero-draft-beside-drafts", ("a penalised row has drafts only where its text repeats, which the "
             "model decides")),
        ),
    )


def param_defs() -> list[ScenarioDef]:
    return [
        _params_mixed(3),
        _params_text(3),
        _params_ngram(3),
    ]
