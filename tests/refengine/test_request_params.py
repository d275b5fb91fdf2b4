"""Requests that carry state: logits processors, stop strings and logprobs, token-exact in both engines.

One mixed batch (an unrestricted request beside restricted ones, more requests than request slots so a
slot is reused right after a restricted request, stop strings, ``min_tokens``, logprobs) runs through the
reference engine with K=0 (the definition) and must come back identical, logprobs bitwise, from the
reference with K=3 drafts and from the async engine in every graph mode with K=0 and K=3 drafts. Every
parameter must change the output (a parameter both engines ignore fails here). transformers'
``generate`` is the oracle for the processors it shares, on tiny checkpoints of both families.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from refengine import LLM, SamplingParams
from refengine.core import EngineError
from refengine.logits_process import Processors, process

PROMPTS = ["Once upon a time", "the cat. the cat. the cat.", "Hello", "abc abc abc abc"]
# unrestricted first and last; each other one changes the default model's output on its prompt
PARAMS = [
    {},
    {"repetition_penalty": 1.5},
    {"frequency_penalty": 1.0, "presence_penalty": 0.5},
    {"logit_bias": {101: 3.0}},
    {"allowed_token_ids": list(range(97, 123))},
    {"bad_words": ["the", "cat"]},
    {"min_tokens": 6, "stop": [" "], "logprobs": 3},
    {"stop": ["at", "e"], "logprobs": 0},
    {"stop": ["re w"], "include_stop_str_in_output": True},
    {"logit_bias": {32: -5.0}, "logprobs": 2},
    {},  # unrestricted, on a slot a restricted request just left
]
REQUESTS = [(PROMPTS[i % len(PROMPTS)], kw) for i, kw in enumerate(PARAMS)]
MAX_TOKENS = 10


def _outputs(llm: LLM, with_params: bool = True) -> list[tuple]:
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=i % 3 != 0, **(kw if with_params else {}))
              for i, (_, kw) in enumerate(REQUESTS)]
    outs = llm.generate([p for p, _ in REQUESTS], params)
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs) for o in outs]


@pytest.fixture(scope="module")
def reference_k0():
    return _outputs(LLM(engine="reference", max_num_seqs=3))


def test_every_parameter_changes_the_output(reference_k0):
    plain = _outputs(LLM(engine="reference", max_num_seqs=3), with_params=False)
    for i, (_, kw) in enumerate(REQUESTS):
        if kw:
            assert reference_k0[i][:2] != plain[i][:2], (
                f"request {i} {kw}: its parameters changed nothing")
        else:
            assert reference_k0[i] == plain[i]


def test_stop_semantics(reference_k0):
    for (prompt, kw), (tokens, text, reason, stop_reason, logprobs) in zip(REQUESTS, reference_k0):
        stops = kw.get("stop")
        if logprobs is not None:
            assert len(logprobs) == len(tokens) and all(t in d for t, d in zip(tokens, logprobs))
            assert all(len(d) in (kw["logprobs"], kw["logprobs"] + 1) for d in logprobs)
        if reason != "stop" or not stops:
            continue
        assert stop_reason in stops
        full = bytes(tokens).decode(errors="replace")
        assert full.endswith(stop_reason) or stop_reason in full[-len(stop_reason) - 4:]
        # nothing past the stop: without its last token the output holds no stop string past min_tokens
        before = bytes(tokens[:-1]).decode(errors="replace")[kw.get("min_tokens", 0):]
        assert not any(s in before for s in stops)
        cut = full.index(stop_reason, max(0, kw.get("min_tokens", 0) - len(stop_reason) + 1))
        expected = full[: cut + len(stop_reason)] if kw.get("include_stop_str_in_output") else full[:cut]
        assert text == expected


@pytest.mark.parametrize("engine, k, drafter, graph_mode", [
    ("reference", 3, "ngram", "none"),
    ("async", 0, "mtp", "full_and_piecewise"),
    ("async", 3, "ngram", "full"),
    pytest.param("async", 3, "mtp", "none", marks=pytest.mark.slow),
    pytest.param("async", 3, "scripted", "piecewise", marks=pytest.mark.slow),
    pytest.param("reference", 3, "mtp", "none", marks=pytest.mark.slow),
])
def test_engines_equal_the_k0_reference(reference_k0, engine, k, drafter, graph_mode):
    extra = {"graph_mode": graph_mode} if engine == "async" else {}
    if drafter == "ngram":
        extra.update(prompt_lookup_min=1, prompt_lookup_max=3)
    llm = LLM(engine=engine, max_num_seqs=3, num_speculative_tokens=k, drafter=drafter, **extra)
    got = _outputs(llm)
    for i, (ref, out) in enumerate(zip(reference_k0, got)):
        assert out == ref, f"request {i} {REQUESTS[i][1]}: {out[:4]} != {ref[:4]}"
    if k:
        outs = llm.generate(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                       frequency_penalty=0.5))
        assert outs[0].num_accepted_tokens > 0 or drafter == "mtp", "no draft was accepted under a penalty"


def test_validation_names_the_field():
    llm = LLM(engine="reference")
    vocab = llm.model_config.vocab_size
    for kw, word in [({"allowed_token_ids": [vocab]}, "allowed_token_ids"),
                     ({"logit_bias": {vocab + 3: 1.0}}, "logit_bias"),
                     ({"prompt_logprobs": 21}, "prompt_logprobs"),
                     ({"logprobs": 21}, "logprobs")]:
        with pytest.raises(EngineError, match=word):
            llm.generate("Hi", SamplingParams(max_tokens=2, **kw))
    for kw, word in [({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
                     ({"presence_penalty": 2.5}, "presence_penalty"),
                     ({"frequency_penalty": -3}, "frequency"),
                     ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"logprobs": -1}, "logprobs"),
                     ({"allowed_token_ids": []}, "allowed_token_ids"), ({"stop": [""]}, "stop"),
                     ({"bad_words": [3]}, "bad_words"), ({"logit_bias": {1: float("nan")}}, "logit_bias")]:
        with pytest.raises(ValueError, match=word):
            SamplingParams(**kw)
    assert SamplingParams(logit_bias={"7": 500}).logit_bias == {7: 100.0}  # clamped, as vLLM


PROMPT_LP = "the cat sat on the mat. the cat sat on the mat."


def _prompt_logprobs(llm: LLM, n: int = 2) -> list:
    outs = llm.generate([PROMPT_LP, "Hello there", PROMPT_LP],
                        [SamplingParams(max_tokens=3, prompt_logprobs=n),
                         SamplingParams(max_tokens=3, logit_bias={32: 5.0}),
                         SamplingParams(max_tokens=3, prompt_logprobs=0, repetition_penalty=1.5)])
    return [(o.prompt_logprobs, o.token_ids, o.num_cached_tokens) for o in outs]


def test_prompt_logprobs_across_chunks_in_both_engines():
    """vLLM's prompt_logprobs: None first, then per prompt token the raw logprob of it given the prompt
    before it (top-n plus the token), unprocessed; chunked prefill (a 16-token budget cuts the prompt) must
    not lose a chunk's last position (vLLM #41411); both engines bitwise, prefix caching read by no request
    asking them (vLLM skips the lookup)."""
    whole = _prompt_logprobs(LLM(engine="reference"))
    first, _, _ = whole[0]
    prompt = list(PROMPT_LP.encode())
    assert first[0] is None and len(first) == len(prompt)
    assert all(prompt[i] in d and len(d) in (2, 3) for i, d in enumerate(first) if i)
    assert whole[1][0] is None and [len(d) for d in whole[2][0][1:]] == [1] * (len(prompt) - 1)
    assert whole[2][0][1:] == [{t: d[t]} for t, d in zip(prompt[1:], first[1:])]  # raw: processors ignored
    for kw in ({"engine": "reference", "max_num_batched_tokens": 16},
               {"engine": "async", "max_num_batched_tokens": 16, "graph_mode": "full_and_piecewise"},
               {"engine": "async", "max_num_batched_tokens": 16, "enable_prefix_caching": True,
                "num_speculative_tokens": 2, "drafter": "ngram"}):
        got = _prompt_logprobs(LLM(**kw))
        for (want, tokens, _), (have, have_tokens, cached) in zip(whole, got):
            assert have_tokens == tokens
            assert have == want, kw  # dict equality of floats: bitwise for finite values
            assert have is None or cached == 0, "a request asking prompt logprobs read the prefix cache"


@pytest.mark.parametrize("engine", ["reference", "async"])
def test_stop_on_the_max_tokens_th_token_finishes_stop(engine):
    """vLLM 0.33's check_stop: EOS, then stop ids, then the length cap, so EOS or a stop id that is the
    max_tokens-th token finishes 'stop' (stop_reason None for EOS, the id for a stop id)."""
    llm = LLM(engine=engine, num_speculative_tokens=2 if engine == "async" else 0, drafter="ngram",
              prompt_lookup_min=1, prompt_lookup_max=2)
    eos = llm.model_config.eos_token_ids[0]
    other = 120 if eos != 120 else 121
    cases = [  # (params, tokens, finish_reason, stop_reason)
        (SamplingParams(max_tokens=3, min_tokens=2, logit_bias={eos: 100.0, other: 50.0}),
         [other, other, eos], "stop", None),
        (SamplingParams(max_tokens=1, logit_bias={other: 100.0}, stop_token_ids=[other]),
         [other], "stop", other),
        (SamplingParams(max_tokens=1, logit_bias={eos: 100.0}, stop_token_ids=[eos]), [eos], "stop", None),
        (SamplingParams(max_tokens=2, logit_bias={eos: 100.0}, ignore_eos=True), [eos, eos], "length", None),
        (SamplingParams(max_tokens=1, logit_bias={eos: 100.0}, ignore_eos=True, stop_token_ids=[eos]), [eos],
         "stop", eos),
    ]
    outs = llm.generate(["Hello"] * len(cases), [c[0] for c in cases])
    for (params, tokens, reason, stop), o in zip(cases, outs):
        assert (o.token_ids, o.finish_reason, o.stop_reason) == (tokens, reason, stop), params


def test_processing_order_is_bias_then_penalties():
    """Bias adds, penalties scale: a bias of +1 on a logit of 1 under repetition 2 gives 1.0, not 1.5."""
    logits = torch.tensor([1.0, 0.5, -1.0, 0.0])
    p = Processors(logit_bias=((0, 1.0),), repetition_penalty=2.0, frequency_penalty=0.25,
                   bad_words_ids=((3, 1),), min_tokens=2, min_tokens_stop_ids=(2,))
    out = process(logits, p, prompt=[0], output=[2, 3])  # the bad word's prefix (3) ends the output
    assert out.tolist() == [1.0, float("-inf"), -2.25, -0.25]
    assert process(logits, p, prompt=[0], output=[3])[2] == float("-inf")  # min_tokens still holds id 2


# ---- transformers' generate as the oracle ---------------------------------------------------------------
class _CharTokenizer:
    """One id per character (ids < 256), so bad words map to ids as the oracle is given them."""

    class _HF:
        eos_token_id = None

        @staticmethod
        def encode(text, add_special_tokens=False):
            return [ord(c) for c in text]

    hf = _HF()
    eos_token_id = bos_token_id = None

    @staticmethod
    def encode(text):
        return [ord(c) for c in text]

    @staticmethod
    def decode(ids):
        return "".join(chr(i) for i in ids)


FAMILIES = [pytest.param("qwen", "next-tiny", id="qwen3-next"),
            pytest.param("nemotron", "nemotron-dense", id="nemotron-h")]


@pytest.mark.parametrize("family, preset", FAMILIES)
def test_processors_match_transformers_generate(family, preset, tiny_checkpoint, tiny_nemotron):
    if family == "qwen":
        from tests.helpers.checkpoints import load_hf_model
        path = tiny_checkpoint(preset)
        hf = load_hf_model(path)
    else:
        from tests.helpers.nemotron_checkpoints import load_hf_model
        path = tiny_nemotron(preset)
        hf = load_hf_model(path)
    llm = LLM(str(path), engine="async", num_speculative_tokens=2, drafter="ngram", prompt_lookup_min=1,
              prompt_lookup_max=2, graph_mode="full")
    llm.engine.core.tokenizer = _CharTokenizer()
    prompt, n = [65, 66, 67, 65, 66, 67, 68], 12
    plain = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids
    common = [t for t in sorted(set(plain), key=plain.count, reverse=True) if chr(t).strip() == chr(t)]
    a, b = next((x, y) for x, y in itertools.pairwise(plain) if x != prompt[-1] and chr(x).strip() == chr(x))
    cases = [
        ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
        ({"bad_words": [chr(common[0]), chr(a) + chr(b)]}, {"bad_words_ids": [[common[0]], [a, b]]}),
        ({"logit_bias": {common[-1]: 4.0}}, {"sequence_bias": {(common[-1],): 4.0}}),
        ({"min_tokens": 6, "stop_token_ids": [common[1]], "logit_bias": {common[1]: 20.0}},
         {"min_new_tokens": 6, "eos_token_id": common[1], "sequence_bias": {(common[1],): 20.0}}),
    ]
    for ours, theirs in cases:
        params = {"ignore_eos": True, **ours}
        out = llm.generate([prompt], SamplingParams(max_tokens=n, logprobs=1, **params))[0]
        with torch.no_grad():
            ids = torch.tensor([prompt])
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                            **{"eos_token_id": None, **theirs})
        expected = g.sequences[0, len(prompt):].tolist()
        stop = theirs.get("eos_token_id")
        if stop is not None and stop in expected:
            expected = expected[: expected.index(stop) + 1]
        assert out.token_ids == expected, f"{family} {ours}: {out.token_ids} != transformers {expected}"
        assert out.token_ids != plain, f"{family} {ours}: the parameter changed nothing"
        raw = torch.log_softmax(torch.stack(g.logits)[:, 0].float(), dim=-1)
        for pos, (t, d) in enumerate(zip(out.token_ids, out.logprobs)):
            assert abs(d[t] - float(raw[pos, t])) < 1e-3, f"{family} {ours}: logprob at {pos}"


# ---- planted bugs from the upstream record: registered mutants, each must break the comparison above ----
@pytest.mark.parametrize("mutant_id", ["params-stale-mask-on-reuse", "params-logprobs-of-rejected-draft"])
def test_planted_bugs_are_caught(reference_k0, mutant_id):
    from conformance.mutants import get_mutant

    llm = LLM(engine="async", max_num_seqs=3, num_speculative_tokens=3, drafter="ngram",
              prompt_lookup_min=1, prompt_lookup_max=3, graph_mode="none")
    get_mutant(mutant_id).patch(llm.engine)
    assert _outputs(llm) != reference_k0, f"{mutant_id} went unnoticed"
