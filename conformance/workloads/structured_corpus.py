"""Scenarios whose requests carry structured outputs (issue 36): JSON-schema, regex and choice requests
beside unconstrained ones, under MTP, n-gram and scripted drafts, preemption, rows that move and seats
that change hands.

Each batch has three seats: constrained and unconstrained requests share steps, finish at different
lengths (rows move) and leave seats that requests of another kind (or another grammar) take. The
scripted drafter proposes each request's own constrained continuation with a wrong token ((true + 1) mod
V, which the grammar refuses almost everywhere) at a position that cycles through the window, so the
grammar rejects drafts at every window position and accepts whole windows; the n-gram drafter's drafts
come from repeated prompt phrases, mostly outside the grammar, beside unconstrained rows that get none.
JSON schemas are compact (``disable_any_whitespace``) and bounded, so the embedded default model completes
them well within ``max_tokens``; one schema keeps vLLM's default whitespace (it may run to its cap). They
need a tokenizer (xgrammar's vocabulary): they run on the embedded default model and skip elsewhere.
"""

from __future__ import annotations

from conformance.workloads.scenario import TIERS, EngineSettings, ScenarioDef

PERSON = {"type": "object", "additionalProperties": False, "required": ["a", "ok"],
          "properties": {"a": {"enum": ["cat", "owl", 7]}, "ok": {"type": "boolean"}}}
LIST = {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "enum": ["a", "bb"]}}
REGEX = "[a-c]{2,5}(x|yz)"
CODE = r"[0-9]{3}-[a-f]{2,4}\."
CHOICE = ["yes", "no", "maybe"]


def _json(schema: dict, compact: bool = True) -> dict:
    return {"structured_outputs": {"json": schema, "disable_any_whitespace": compact}}


def _mixed(b, k: int) -> None:
    """Constrained requests of each kind next to unconstrained ones, seats changing hands both ways."""
    n = b.size(26, 48)
    b.add(9, n, params=_json(PERSON))
    b.add(7, n)  # unconstrained, beside the others
    b.add(6, n, params={"structured_outputs": {"regex": REGEX}})
    b.add(8, n, arrival=1, params={"structured_outputs": {"choice": CHOICE}})
    b.add(5, 12, arrival=2)  # unconstrained, onto a seat a constrained request leaves
    b.add(10, n, arrival=3, params={"structured_outputs": {"regex": CODE}})
    b.add(11, n, arrival=4, params=_json(LIST))
    b.add(6, 10, arrival=5)
    b.add(7, n, arrival=6, params=_json(PERSON, compact=False))  # may run to its cap
    b.add(8, n, arrival=7, params={"structured_outputs": {"choice": CHOICE}})
    b.add(9, n, arrival=8, params={"structured_outputs": {"regex": REGEX}})
    for i in range(b.size(0, 6)):
        b.add(b.rng.randint(3, 20), n, arrival=9 + i, params={} if i % 2 else _json(PERSON))


def _ngram(b, k: int) -> None:
    """Constrained requests whose prompts repeat a phrase (n-gram drafts, mostly outside the grammar) and
    whose outputs repeat (drafts inside it), beside unconstrained ones that get no drafts."""
    n = b.size(20, 40)
    for i in range(b.size(6, 10)):
        if i % 2:
            b.add(12, n, arrival=i // 2, repeat=3,
                  params={"structured_outputs": {"regex": "(ab|ba|aab){2,9}x" if i % 4 == 1 else REGEX}})
        else:
            b.add(10, n - i, arrival=i // 2)  # unconstrained: rows without drafts


def _preemption(b, k: int) -> None:
    """More constrained requests than the KV pool holds: they are preempted and resumed mid-output."""
    n = b.size(20, 40)
    for i in range(b.size(4, 8)):
        params = [_json(LIST), {"structured_outputs": {"regex": CODE}}, {}][i % 3]
        b.add(12 + 3 * i, n, arrival=i // 3, params=params)


# Why the grammar triggers are the checkpoint's: which of the ids a grammar allows the model picks, so
# when each constrained request completes (and leaves its seat), and whether a draft is one the grammar
# and the model keep.
CHOICE_OF_MODEL = "the model picks among the ids a grammar allows, so where and when grammars complete is its"


def _decides(*triggers: str) -> tuple[tuple[str, str], ...]:
    return tuple((t, CHOICE_OF_MODEL) for t in triggers)


def structured_defs() -> list[ScenarioDef]:
    mixed = ("unrestricted-beside-restricted", "slot-reused-unrestricted", "params-rows-reordered",
             "grammar-draft-rejected", "grammar-window-accepted", "grammar-slot-changes-hands")
    return [
        ScenarioDef(
            "structured-scripted-k3",
            "JSON-schema, regex and choice requests beside unconstrained ones, three seats changing hands "
            "(scripted drafter, a wrong draft cycling through the window, K=3; needs a tokenizer)",
            EngineSettings(num_speculative_tokens=3, drafter="scripted", pattern="cycle", max_num_seqs=3),
            lambda b: _mixed(b, 3), mixed + ("grammar-end-in-window",), TIERS,
            model_decides=_decides(*[t for t in mixed if t != "unrestricted-beside-restricted"],
                                   "grammar-end-in-window")),
        ScenarioDef(
            "structured-mtp-k3",
            "JSON-schema, regex and choice requests beside unconstrained ones (MTP drafts, K=3; needs a "
            "tokenizer)",
            EngineSettings(num_speculative_tokens=3, drafter="mtp", max_num_seqs=3),
            lambda b: _mixed(b, 3), ("unrestricted-beside-restricted", "grammar-draft-rejected"),
            ("nightly",), model_decides=_decides("grammar-draft-rejected")),
        ScenarioDef(
            "structured-ngram-k3",
            "regex requests with n-gram drafts beside unconstrained rows without any (K=3; needs a "
            "tokenizer)",
            EngineSettings(num_speculative_tokens=3, drafter="ngram", prompt_lookup_min=2,
                           prompt_lookup_max=3, max_num_seqs=4),
            lambda b: _ngram(b, 3), ("grammar-draft-rejected", "grammar-zero-draft-beside-drafts"), TIERS,
            model_decides=_decides("grammar-draft-rejected", "grammar-zero-draft-beside-drafts")),
        ScenarioDef(
            "structured-preemption-k3",
            "JSON-schema and regex requests preempted under a tiny KV pool and resumed mid-output (scripted "
            "drafter, K=3; needs a tokenizer)",
            EngineSettings(num_speculative_tokens=3, drafter="scripted", pattern="cycle", max_num_seqs=4,
                           block_size=4, num_kv_blocks=18, max_num_batched_tokens=64, max_model_len=60),
            lambda b: _preemption(b, 3), ("params-preemption", "grammar-draft-rejected"), TIERS,
            model_decides=_decides("params-preemption", "grammar-draft-rejected")),
    ]
