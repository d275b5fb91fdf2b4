"""Structured outputs: the parameters, the errors, the grammar's window masks, and both engines.

The default model's byte-level tokenizer gives xgrammar its vocabulary. JSON-schema, regex and choice
requests run beside an unconstrained one through the reference with K=0 (the definition), the reference
with K=3 and the async engine (K=3, FULL graphs and eager): outputs, finish reasons and acceptance identical,
every completed output in its grammar's language, judged by ``json`` / ``re`` / membership.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from refengine import LLM, SamplingParams
from refengine.config import ConfigError
from refengine.core import EngineError
from refengine.grammar import apply_bitmask
from refengine.structured_outputs import StructuredOutputsParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "ok"],
          "properties": {"a": {"enum": ["cat", "owl"]}, "ok": {"type": "boolean"}}}
CONSTRAINTS = [
    {"json": SCHEMA, "disable_any_whitespace": True},
    {"regex": "[a-c]{2,5}(x|yz)"},
    None,
    {"choice": ["yes", "no", "maybe"]},
    {"regex": r"[0-9]{3}-[a-f]{2,4}\."},
]
PROMPTS = ["Data: ", "The cat ", "Once upon", "Answer", "Hello there"]


def _params(so, **kw):
    return SamplingParams(max_tokens=30, structured_outputs=so, **kw)


def _run(engine: str, k: int, **settings):
    llm = LLM(engine=engine, num_speculative_tokens=k, max_num_seqs=3, **settings)
    outs = llm.generate(PROMPTS, [_params(so) for so in CONSTRAINTS])
    if engine == "async":  # the grammar's bitmask adds no wait: one per step, on the step before
        assert llm.engine.stream.num_host_waits <= llm.engine.stats.steps + 1, "more than one sync per step"
    return [(o.token_ids, o.finish_reason, o.acceptance, o.text) for o in outs]


@pytest.fixture(scope="module")
def definition():
    return _run("reference", 0)


@pytest.fixture(scope="module")
def reference_k3():
    return _run("reference", 3)


def _in_language(so: dict, text: str) -> bool:
    if "json" in so:
        value = json.loads(text)
        return set(value) == {"a", "ok"} and value["a"] in ("cat", "owl") and isinstance(value["ok"], bool)
    if "regex" in so:
        return re.fullmatch(so["regex"], text) is not None
    return text in so["choice"]


def test_constrained_outputs_complete_in_their_grammar(definition):
    for so, (tokens, reason, _, text) in zip(CONSTRAINTS, definition):
        if so is None:
            continue
        assert reason == "stop" and _in_language(so, text), (so, text)
    assert definition[2][1] == "length"  # the unconstrained one is not held to anything


@pytest.mark.parametrize("engine,settings", [
    ("reference", {}),
    ("async", {"graph_mode": "full_and_piecewise"}),
    ("async", {"graph_mode": "full_and_piecewise", "delay_copies": True, "hazard_check": True}),
    pytest.param("async", {"graph_mode": "none", "drafter": "ngram"}, marks=pytest.mark.slow),
    pytest.param("async", {"graph_mode": "piecewise"}, marks=pytest.mark.slow),
], ids=["reference", "async-full", "async-full-delay-hazard", "async-none-ngram", "async-piecewise"])
def test_speculation_is_lossless_and_engines_agree(definition, reference_k3, engine, settings):
    got = reference_k3 if engine == "reference" else _run(engine, 3, **settings)
    assert [g[:2] for g in got] == [d[:2] for d in definition]
    if engine == "async":
        drafter = {k: v for k, v in settings.items() if k == "drafter"}
        assert got == (_run("reference", 3, **drafter) if drafter else reference_k3)


def test_params_are_validated_by_name():
    with pytest.raises(ConfigError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ConfigError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ConfigError, match="choice must be a list of non-empty strings"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(ConfigError, match="unknown field"):
        SamplingParams(structured_outputs={"regexp": "a"})
    assert SamplingParams(structured_outputs={"json": SCHEMA}).structured_outputs.kind == "json"


@pytest.mark.parametrize("engine", ["reference", "async"])
def test_a_grammar_xgrammar_refuses_is_the_requests_error_and_others_run(engine):
    llm = LLM(engine=engine, num_speculative_tokens=2)
    refused = "structured_outputs\\.{}: xgrammar cannot compile"
    with pytest.raises(EngineError, match=r"request 'bad': " + refused.format("regex")):
        llm.add_request("bad", [1, 2, 3], _params({"regex": "[a-"}))
    with pytest.raises(EngineError, match=r"request 'bad2': " + refused.format("json")):
        llm.add_request("bad2", [1, 2, 3], _params({"json": {"type": 5}}))
    out = llm.generate(["Answer"], _params({"choice": ["yes", "no"]}))[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


def test_the_grammar_end_stops_even_with_ignore_eos():
    llm = LLM(engine="async", num_speculative_tokens=3)
    out = llm.generate(["Answer"], _params({"choice": ["yes", "no", "maybe"]}, ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no", "maybe")


def test_structured_outputs_need_a_tokenizer(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("next-tiny")))
    with pytest.raises(EngineError, match="request 'r': structured_outputs needs a tokenizer"):
        llm.add_request("r", [1, 2], _params({"regex": "a+"}))


def test_a_preempted_request_keeps_its_matcher_for_the_step_in_flight():
    """Preemption frees the slot but leaves the matcher: the kept tokens of a step still in flight are
    committed after it, and must advance it (a draft that completes the grammar finishes the request
    there; without a matcher the bonus token after it was kept, and readmission refused the outputs)."""
    eng = LLM(engine="async", num_speculative_tokens=3).engine
    req = eng.core.add_request("r", [1, 2], _params({"regex": "ab"}, ignore_eos=True))
    req.idx = 0
    eng.grammars.admit(req)
    matcher = req.grammar
    eng.grammars.release(req)
    assert eng.grammars.owner[0] is None and req.grammar is matcher
    assert matcher.accept(ord("a")) and matcher.accept(ord("b"))  # committed tokens still advance it


def test_window_masks_follow_the_drafts_and_roll_back():
    llm = LLM(engine="reference")
    core = llm.engine.core
    req = core.add_request("r", [1, 2], _params({"regex": "ab(c|d)"}))
    g = req.grammar
    allowed = lambda row: {t for t in range(260) if (int(row[t // 32]) >> (t % 32)) & 1}
    bm = g.window_bitmask([ord("a"), ord("b"), ord("x"), ord("c")])
    assert bm.shape == (5, 9)
    assert [allowed(r) for r in bm[:3]] == [{ord("a")}, {ord("b")}, {ord("c"), ord("d")}]
    assert (bm[3:] == -1).all()  # past a draft the grammar refuses: nothing is kept there
    assert allowed(g.window_bitmask([])[0]) == {ord("a")}  # the drafts were rolled back
    logits = torch.zeros(2, 260)
    masked = apply_bitmask(logits, bm[1:3])
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [ord("b")]
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [ord("c"), ord("d")]
    assert g.accept(ord("a")) and not g.accept(ord("a")) and g.accept(ord("b"))


def test_prefix_cache_hits_change_nothing():
    prefix = "The answer to the question, in one word, is: "
    waves = [[prefix + "x"], [prefix + "y", prefix + "z"]]
    constraints = [{"choice": ["yes", "no", "maybe"]}, {"regex": "[a-c]{2,5}(x|yz)"}]

    def run(**settings):
        llm = LLM(num_speculative_tokens=3, block_size=16, **settings)
        outs = []
        for wave in waves:
            outs += llm.generate(wave, [_params(constraints[i % 2]) for i in range(len(wave))])
        return outs

    cached = run(engine="async", enable_prefix_caching=True)
    plain = run(engine="reference")
    assert any(o.num_cached_tokens for o in cached), "the second wave hits the first's blocks"
    assert [(o.token_ids, o.finish_reason, o.acceptance) for o in cached] == \
        [(o.token_ids, o.finish_reason, o.acceptance) for o in plain]
