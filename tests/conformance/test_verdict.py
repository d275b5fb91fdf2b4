"""``--verdict rescored``: the reference scores the engine's own output, a token within the calibrated
tolerance of the reference's pick is a near-tie and one beyond it structural; the bitwise checks say why
they are n/a where the engine is not bitwise the reference; the calibration table is its own figures."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from conformance.checks import CheckInputs
from conformance.checks.rescored import check_rescored
from conformance.scoring import Scorer, score_trace
from conformance.trace import RequestTrace, Trace
from conformance.verdict import CALIBRATION_FILE, CalibrationError, Verdict, VerdictError, choose
from conformance.workloads import EngineSettings, RequestSpec, Scenario
from refengine import LLM, SamplingParams

TABLE = {"format": "conformance-calibration/1", "headroom": 2.0,
         "pairs": {"bfloat16/float32": {"tolerance": 0.2, "max_margin": 0.1, "positions": 10}}}


# ---- choosing the verdict ----------------------------------------------------------------------------------
def test_auto_judges_a_bitwise_engine_exactly_only_in_the_references_dtype_and_device():
    assert choose("auto", bitwise=True, dtype="bfloat16").mode == "exact"
    for other in ({"bitwise": False, "dtype": "bfloat16"},
                  {"bitwise": True, "dtype": "bfloat16", "reference_dtype": "float32"},
                  {"bitwise": True, "dtype": "bfloat16", "reference_dtype": "float32", "device": "cuda",
                   "reference_device": "cpu"}):
        v = choose("auto", **other, tolerance=0.5)
        assert v.rescored and v.tolerance == 0.5 and not v.bitwise_comparable, other
    # rescored with a bitwise engine in the reference's own dtype keeps the bitwise checks
    assert choose("rescored", bitwise=True, dtype="float32", tolerance=0.0).bitwise_comparable


def test_rescored_holds_a_bitwise_engines_bitwise_checks_to_the_reference_in_its_own_dtype():
    """An engine declaring 'bitwise' judged by a reference in another dtype (or on another device): its
    bitwise checks are held to the reference engine in its own dtype; one not declaring it: n/a, as before."""
    held = choose("rescored", bitwise=True, dtype="bfloat16", reference_dtype="float32", table=TABLE)
    assert held.bitwise_in_own_dtype and not held.bitwise_comparable
    assert "the bitwise checks are held to the reference engine in the engine's own dtype, bfloat16" in \
        held.describe()
    own = held.own_dtype()
    assert (own.reference_dtype, own.bitwise_comparable) == ("bfloat16", True)
    assert not own.bitwise_in_own_dtype
    assert choose("auto", bitwise=True, dtype="float32", device="cuda", reference_device="cpu",
                  tolerance=0.1).bitwise_in_own_dtype
    for v in (choose("rescored", bitwise=False, dtype="bfloat16", reference_dtype="float32", table=TABLE),
              choose("rescored", bitwise=True, dtype="float32", tolerance=0.0),  # comparable: kept as is
              choose("exact", bitwise=True, dtype="bfloat16")):
        assert not v.bitwise_in_own_dtype, v
    assert "the bitwise checks are n/a, each saying why" in choose(
        "rescored", bitwise=False, dtype="bfloat16", reference_dtype="float32", table=TABLE).describe()


def test_exact_refuses_a_reference_it_cannot_compare_with_bitwise():
    with pytest.raises(VerdictError, match="verdict exact compares bitwise"):
        choose("exact", bitwise=True, dtype="bfloat16", reference_dtype="float32")
    with pytest.raises(VerdictError, match="applies to --verdict rescored only"):
        choose("exact", bitwise=True, dtype="float32", tolerance=0.1)


def test_the_tolerance_of_a_pair_comes_from_the_table_and_an_uncalibrated_pair_is_refused():
    v = choose("rescored", bitwise=False, dtype="bfloat16", reference_dtype="float32", table=TABLE)
    assert v.tolerance == 0.2 and "max margin 0.1" in v.source and "headroom 2.0" in v.source
    wanted = "conformance calibrate --dtypes float16` measures it"
    with pytest.raises(CalibrationError, match=wanted):
        choose("rescored", bitwise=False, dtype="float16", reference_dtype="float32", table=TABLE)


def test_the_shipped_table_is_its_own_figures_over_every_family():
    """Each pair's tolerance is its largest margin times the stated headroom, that margin the largest of
    its families', and every registered family was calibrated for the engine dtypes against float32."""
    from refengine.model.registry import FAMILIES

    table = json.loads(CALIBRATION_FILE.read_text())
    assert {"bfloat16/float32", "float16/float32"} <= set(table["pairs"])
    assert set(table["engines"]) == {"reference", "async"}
    for key, pair in table["pairs"].items():
        families = pair["families"]
        assert pair["max_margin"] == max(f["max_margin"] for f in families.values()), key
        assert pair["tolerance"] == round(pair["max_margin"] * table["headroom"], 6), key
        assert pair["positions"] == sum(f["positions"] for f in families.values()) > 0, key
        assert {name.split(" ")[0] for name in families} == {f.name for f in FAMILIES}, key


# ---- scoring ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scorer(tiny_checkpoint) -> Scorer:
    return Scorer(tiny_checkpoint, "float32")


@pytest.fixture(scope="module")
def greedy(tiny_checkpoint):
    """``run(prompt, **params) -> tokens``: the reference engine's own float32 greedy output."""
    llm = LLM(model=tiny_checkpoint)

    def run(prompt, **params):
        params = SamplingParams(max_tokens=10, ignore_eos=True, **params)
        return llm.generate([list(prompt)], params)[0].token_ids

    return run


def test_teacher_forcing_reads_the_logits_before_each_token_under_the_requests_parameters(scorer, greedy):
    plain = greedy((229, 46))
    s = scorer.score("r", [229, 46], plain)
    assert s.argmax == plain and s.margins == [0.0] * len(plain)  # its own picks, at the right positions
    params = {"allowed_token_ids": [3, 9, 17, 40, 81], "logit_bias": {9: 2.5}, "repetition_penalty": 1.3}
    biased = greedy((229, 46), **params)
    assert biased != plain
    assert scorer.score("r", [229, 46], biased, params).margins == [0.0] * len(biased)
    raw = scorer.score("r", [229, 46], biased)  # without the request's processors the picks differ
    assert any(m > 0 for m in raw.margins)


def _inputs(tokens_by_request: dict, prompts: dict, verdict: Verdict, scorer: Scorer) -> CheckInputs:
    requests = tuple(RequestSpec(rid, tuple(prompts[rid]), len(t)) for rid, t in tokens_by_request.items())
    scenario = Scenario("planted", "", "default", EngineSettings(), requests)

    def trace(name):
        return Trace(name, "planted", requests={
            rid: RequestTrace(rid, list(prompts[rid]), list(t), "length", [])
            for rid, t in tokens_by_request.items()})

    test = trace("under test")
    return CheckInputs(scenario, trace("reference"), test, None, 256, True, True, verdict=verdict,
                       scores={"test": score_trace(scorer, test, scenario)})


def test_a_planted_near_tie_passes_and_a_planted_corruption_beyond_the_tolerance_is_structural(scorer,
                                                                                               greedy):
    prompt = (229, 46)
    tokens = greedy(prompt)
    logits = scorer.logits([*prompt, *tokens[:-1]])[-1]  # the last position's: nothing after it moves
    ranked = logits.argsort(descending=True).tolist()
    gap = float(logits[ranked[0]] - logits[ranked[1]])
    tie, worst = [*tokens[:-1], ranked[1]], [*tokens[:-1], ranked[-1]]
    verdict = Verdict("rescored", "bfloat16", "float32", tolerance=gap * 1.01, source="test",
                      bitwise_comparable=False)
    near = check_rescored(_inputs({"r00": tie}, {"r00": prompt}, verdict, scorer))
    assert near.status == "pass" and "1 near-tie(s)" in near.summary, near.summary
    divergences = near.details["requests"]["r00"]["divergences"]
    assert divergences == [[9, ranked[1], ranked[0], round(gap, 6), "near-tie"]]
    bad = check_rescored(_inputs({"r00": worst, "r01": tie}, {"r00": prompt, "r01": prompt}, verdict, scorer))
    assert bad.failed and bad.request_id == "r00" and bad.details["position"] == 9, bad.summary
    assert "structural" in bad.summary and "first divergence at output position 9" in bad.report
    # the same tie is structural once the tolerance is below its margin
    tighter = replace(verdict, tolerance=gap * 0.99)
    tight = check_rescored(_inputs({"r01": tie}, {"r01": prompt}, tighter, scorer))
    assert tight.failed and "structural" in tight.summary


def test_the_check_is_not_applicable_under_exact(scorer, greedy):
    tokens = greedy((229, 46))
    inputs = _inputs({"r00": tokens}, {"r00": (229, 46)}, Verdict(), scorer)
    result = check_rescored(inputs)
    assert result.status == "n/a" and "verdict exact" in result.summary


# ---- this project's own engines in bfloat16 and float16 against the float32 reference --------------------
def _case(engine: str, model: str | None, dtype: str, reference_dtype: str | None = "float32", **kw):
    from conformance.harness import Case
    from conformance.model import preflight
    from conformance.session import resolve_engine

    facts = preflight(model, "cpu", dtype)
    return Case(engine, resolve_engine(engine), facts, model, "default", "cpu", dtype, allow_unexercised=True,
                verdict="rescored", reference_dtype=reference_dtype, **kw)


@pytest.mark.slow
def test_a_bfloat16_run_passes_rescored_and_every_report_says_so(tmp_path):
    """The async engine in bfloat16 on the tiny Nemotron-H: a near-tie at mtp-k3's r00 (no false alarm); the
    bitwise checks held to the reference engine in bfloat16, each saying so; text, JSON and JUnit name the
    verdict."""
    import xml.etree.ElementTree as ET

    from tests.conformance.test_cli import run_cli

    code, out = run_cli("run", "--engine", "async", "--model", "tiny:nemotron_h", "--dtype", "bfloat16",
                        "--verdict", "rescored", "--reference-dtype", "float32", "--scenario", "mtp-k3",
                        "--report-json", str(tmp_path / "r.json"), "--junit-xml", str(tmp_path / "r.xml"))
    assert code == 0, out
    assert "verdict rescored: the reference engine in float32 scores the engine's own bfloat16 output" in out
    assert "PASS  mtp-k3  [" in out and "; verdict rescored]" in out
    assert "engine in bfloat16, rescored by the reference in float32" in out
    (scenario,) = json.loads((tmp_path / "r.json").read_text())["scenarios"]
    assert (scenario["verdict"], scenario["dtype"], scenario["reference_dtype"]) == ("rescored", "bfloat16",
                                                                                      "float32")
    checks = {c["check"]: c for c in scenario["checks"]}
    assert checks["rescored"]["status"] == "pass"
    assert checks["rescored"]["details"]["requests"]["r00"]["near_ties"] >= 1  # a real divergence, judged
    # the async engine declares itself bitwise the reference in its own dtype: the bitwise checks are held to
    # the reference engine in bfloat16, and say so; the greedy tokens are the rescoring's
    assert ("the bitwise checks are held to the reference engine in the engine's own dtype, bfloat16" in out)
    assert checks["rescored"]["details"]["bitwise_checks_held_to"] == "bfloat16"
    assert checks["tokens"]["status"] == "n/a" and "judged by 'rescored'" in checks["tokens"]["summary"]
    for name in ("acceptance", "drafts", "logits-digests", "spec-lossless"):
        assert checks[name]["status"] == "pass", name
        assert "held to the reference engine in bfloat16, the engine's own dtype" in checks[name]["summary"]
        assert checks[name]["details"]["held_to"]["reference_dtype"] == "bfloat16", name
    case = ET.parse(tmp_path / "r.xml").getroot().find(".//testcase")
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert props["verdict"] == "rescored" and props["reference_dtype"] == "float32"
    assert float(props["tolerance"]) == scenario["tolerance"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["bfloat16/float32", "float16/float32"])
def test_the_calibrations_worst_divergence_of_a_pair_replays_as_a_near_tie(pair):
    """The largest margin the calibration saw for the pair, rerun: the same token at the same position, the
    same margin, a near-tie; the scenario passes."""
    from conformance.harness import run_scenario

    table = json.loads(CALIBRATION_FILE.read_text())["pairs"][pair]
    family, worst = max(((f, d["worst"]) for f, d in table["families"].items() if d["worst"]),
                        key=lambda fw: fw[1]["margin"])
    model = family.split("(")[1].rstrip(")")
    dtype, reference = pair.split("/")
    case = _case(worst["engine"], None if model == "embedded default model" else model, dtype, reference)
    result, _ = run_scenario(worst["scenario"], case)
    assert result.ok, [c.summary for c in result.failures]
    rescored = {c.check: c for c in result.checks}["rescored"].details["requests"][worst["request"]]
    divergence = next(d for d in rescored["divergences"] if d[0] == worst["position"])
    assert divergence[1:3] == [worst["token"], worst["reference_pick"]]
    assert divergence[3] == pytest.approx(worst["margin"], abs=1e-6) and divergence[4] == "near-tie"
    assert worst["margin"] == pytest.approx(table["max_margin"], abs=1e-6)


class _NotDeclaringBitwise:
    """An engine adapter that does not declare 'bitwise' (the same engine underneath): nothing may be held
    to the reference in its own dtype."""

    def __init__(self, inner):
        self.inner, self.name = inner, f"{inner.name} (not declaring bitwise)"

    def supports(self, feature: str) -> bool:
        return feature != "bitwise" and self.inner.supports(feature)

    def start(self, spec):
        return self.inner.start(spec)


SPECULATING = {"mtp-k3", "ngram-k3", "sampling-mixed-mtp-k3"}


@pytest.mark.parametrize("engine,dtype,scenario,declared", [
    ("async", "bfloat16", "mtp-k3", True),
    ("reference", "float16", "short-prompts-k0", True),
    pytest.param("async", "bfloat16", "mtp-k3", False, marks=pytest.mark.slow),
    pytest.param("async", "bfloat16", "ngram-k3", True, marks=pytest.mark.slow),
    pytest.param("async", "bfloat16", "sampling-mixed-mtp-k3", True, marks=pytest.mark.slow),
    pytest.param("async", "bfloat16", "sampling-preemption-k0", True, marks=pytest.mark.slow),
    pytest.param("reference", "float16", "mtp-k3", True, marks=pytest.mark.slow)])
def test_the_own_engines_in_bfloat16_and_float16_raise_no_false_alarm(engine, dtype, scenario, declared):
    """On the tiny Nemotron-H: in bfloat16 mtp-k3's r00 flips a near-tie at output position 3, judged a
    near-tie; nothing fails. The engines declare themselves bitwise the reference in their own dtype, so the
    bitwise checks are held to the reference engine in that dtype (and pass); an adapter not declaring it has
    them n/a with the reason, and its speculation held to the engine's own K=0 run."""
    from conformance.harness import run_scenario

    case = _case(engine, "tiny:nemotron_h", dtype)
    if not declared:
        case = replace(case, adapter=_NotDeclaringBitwise(case.adapter))
    result, traces = run_scenario(scenario, case)
    assert result.ok, [c.summary for c in result.failures]
    checks = {c.check: c for c in result.checks}
    assert checks["rescored"].status == "pass"
    held = f"held to the reference engine in {dtype}, the engine's own dtype"
    bitwise = ("logits-digests", "acceptance", "drafts") if scenario in SPECULATING else ("logits-digests",)
    if declared:
        assert checks["rescored"].details["bitwise_checks_held_to"] == dtype
        assert traces["reference-own"].engine == f"reference in {dtype} (the engine's own dtype)"
        for name in bitwise:
            assert checks[name].status == "pass" and held in checks[name].summary, name
        sampled = scenario.startswith("sampling")
        assert checks["tokens"].status == ("pass" if sampled else "n/a"), checks["tokens"].summary
        assert "greedy tokens judged by 'rescored'" in checks["tokens"].summary
    else:
        assert "reference-own" not in traces and "bitwise_checks_held_to" not in checks["rescored"].details
        for name in ("tokens", *bitwise):
            assert checks[name].status == "n/a" and "verdict rescored" in checks[name].summary, name
    if scenario in SPECULATING:
        spec = checks["spec-lossless"]
        if declared:
            assert "plain-own" in traces and spec.status == "pass" and held in spec.summary
        else:
            assert "test-plain" in traces and traces["test-plain"] is not traces["plain"]  # its own K=0 run
            assert spec.status == "pass" and "own K=0 run" in spec.summary
    if dtype == "bfloat16" and scenario == "mtp-k3":
        r00 = checks["rescored"].details["requests"]["r00"]
        assert r00["first_divergence"] == 3 and r00["near_ties"] == 1 and r00["structural"] == 0, r00


def test_a_state_corrupting_mutant_in_bfloat16_is_structural_not_a_near_tie():
    """pad-rows-on-a-real-slot: FULL-graph padding rows write a real request's state slot; in bfloat16 against
    the float32 reference its tokens fall far below the reference's picks."""
    from conformance.harness import run_scenario

    result, _ = run_scenario("mtp-k1", _case("mutant:pad-rows-on-a-real-slot", None, "bfloat16"))
    failed = {c.check: c for c in result.failures}
    assert "rescored" in failed and "structural" in failed["rescored"].summary, result.checks
    margin = failed["rescored"].details["requests"][failed["rescored"].request_id]["worst_margin"]
    assert margin > 5 * result.tolerance


@pytest.mark.slow
def test_rescored_in_the_references_own_dtype_keeps_the_bitwise_checks_of_a_bitwise_engine():
    """chunk-end-drafter-token feeds the drafter a wrong token at a prompt chunk's end: the output stays right
    (rescoring cannot see it), but the async engine is bitwise the reference in float32, so 'drafts' holds."""
    from conformance.harness import run_scenario

    result, _ = run_scenario("chunk-tails-k3", _case("mutant:chunk-end-drafter-token", None, "float32", None))
    statuses = {c.check: c.status for c in result.checks}
    assert statuses["drafts"] == "fail" and statuses["rescored"] == "pass", statuses
    assert statuses["tokens"] == statuses["acceptance"] == "pass"


# ---- every mutant under --verdict rescored (slow) ---------------------------------------------------------
def _first_failure(mutant_id: str, dtype: str, reference_dtype: str | None, model: str | None = None):
    """(scenario, failed checks) of the first of the mutant's own scenarios it fails under rescored on
    ``model`` (None: the embedded default model; a mutant of another family's mixer: that family's tiny
    model), or None."""
    from conformance.harness import run_scenario
    from conformance.mutants import get_mutant
    from conformance.mutants.run import model_for, scenario_order

    mutant = get_mutant(mutant_id)
    model = model_for(mutant, model)
    case = _case(f"mutant:{mutant_id}", model, dtype, reference_dtype)
    for sid in [s for s in scenario_order(mutant, "default") if s in mutant.scenarios]:
        result, _ = run_scenario(sid, case)
        assert result.error is None, result.error
        if result.failures:
            return sid, [c.check for c in result.failures]
    return None


@pytest.mark.slow
@pytest.mark.parametrize("mutant_id", [m.id for m in __import__("conformance.mutants").mutants.MUTANTS])
def test_every_mutant_is_caught_under_rescored(mutant_id, tiny_checkpoint):
    """In the run's own dtype (the default reference dtype) with the bitwise checks kept and 'rescored', on
    the checkpoint tests/conformance/test_mutants.py holds every mutant to under the exact verdict."""
    assert _first_failure(mutant_id, "float32", None, tiny_checkpoint) is not None, mutant_id


# ---- the reports say which verdict judged ----------------------------------------------------------------
def test_the_text_and_json_reports_name_the_verdict():
    from conformance.report_files import build_json
    from conformance.report_text import format_result, format_summary, status_line
    from conformance.results import CheckResult, ScenarioResult

    checks = [CheckResult("rescored", "pass", "ok")]
    rescored = ScenarioResult("mtp-k3", "d", "default", "async", "m", "K=3", checks, dtype="bfloat16",
                              verdict="rescored", reference_dtype="float32", tolerance=0.25)
    exact = replace(rescored, scenario_id="mtp-k1", verdict="exact", reference_dtype="bfloat16",
                    tolerance=None)
    block = format_result(rescored)
    assert "dtype             : bfloat16 (engine under test), float32 (reference)" in block
    assert "verdict           : rescored by the reference in float32 (a token more than 0.25 nats" in block
    assert "verdict           : exact" in format_result(exact)
    assert status_line(rescored).count("verdict rescored") == 1 and "verdict" not in status_line(exact)
    assert ("both engines in bfloat16, engine in bfloat16, rescored by the reference in float32 (tolerance "
            "0.25 nats)") in format_summary([exact, rescored], 1.0)
    report = build_json([exact, rescored], engine="async", tier="default", model="m", environment={},
                        elapsed=1)
    assert report["verdict"] == "exact, rescored"
    assert [s["verdict"] for s in report["scenarios"]] == ["exact", "rescored"]


# ---- an engine bitwise the reference in its own dtype, judged by the float32 reference ---------------------
def _small(scenario_id: str, keep: tuple[str, ...], max_tokens: int, vocab_size: int):
    """A few of a scenario's requests, shortened: one mutant's symptom in a fraction of the run."""
    from conformance.workloads import get_def

    scenario = get_def(scenario_id).materialize("default", vocab_size)
    return replace(scenario, requests=tuple(replace(r, max_tokens=max_tokens) for r in scenario.requests
                                            if r.request_id in keep))


def test_a_bitwise_engines_draft_only_corruption_is_caught_in_bfloat16_against_float32():
    """drafts-counted-from-host verifies the host's K draft positions, fillers included: its tokens stay its
    own (nothing for the float32 rescoring to see), its acceptance does not. The async engine declares itself
    bitwise the reference in its own dtype, so in bfloat16 judged by the float32 reference its acceptance is
    held to the reference engine's run in bfloat16 and the mutant is caught; an adapter of the same engine
    that does not declare 'bitwise' keeps 'acceptance' n/a, as before."""
    from conformance.harness import run_scenario

    case = _case("mutant:drafts-counted-from-host", None, "bfloat16")
    assert case.judged.bitwise_in_own_dtype and not case.judged.bitwise_comparable
    assert "the bitwise checks are held to the reference engine in the engine's own dtype, bfloat16" in \
        case.judged.describe()
    scenario = _small("ngram-k1", ("r00",), 17, case.facts.vocab_size)
    result, traces = run_scenario(scenario, case, only="acceptance")
    (acceptance,) = result.checks
    assert acceptance.failed and acceptance.request_id == "r00", acceptance.summary
    assert "held to the reference engine in bfloat16, the engine's own dtype" in acceptance.summary
    assert acceptance.details["held_to"]["reference_dtype"] == "bfloat16"
    assert "in bfloat16 (the engine's own dtype)" in acceptance.report  # the reference it was held to
    assert (traces["reference"].engine, traces["reference-own"].engine) == (
        "reference", "reference in bfloat16 (the engine's own dtype)")

    undeclared = replace(case, adapter=_NotDeclaringBitwise(case.adapter))
    assert not undeclared.judged.bitwise_in_own_dtype
    result, traces = run_scenario(scenario, undeclared, only="acceptance")
    (acceptance,) = result.checks
    assert acceptance.status == "n/a" and "the engine is not bitwise the reference here" in acceptance.summary
    assert "reference-own" not in traces


@pytest.mark.slow
@pytest.mark.parametrize("mutant_id", [m.id for m in __import__("conformance.mutants").mutants.MUTANTS])
def test_every_mutant_is_caught_in_bfloat16_against_float32(mutant_id):
    """Every mutant, the engine in bfloat16 judged by the float32 reference: 'rescored' (a corruption does
    not hide inside the bfloat16 tolerance), the per-engine rules and the invariants, and, this project's
    engines declaring themselves bitwise the reference in their own dtype, the bitwise checks (acceptance,
    drafts, logits digests, logprobs, seeded draws) held to the reference engine in bfloat16: a mutant whose
    only symptom is one of those is caught too. On the embedded default model (a family's mixer mutants on
    that family's tiny model)."""
    assert _first_failure(mutant_id, "bfloat16", "float32") is not None, mutant_id
