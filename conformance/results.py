"""Check and scenario results: what the reports, the CLI and the pytest plugin consume."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

PASS, FAIL, NA = "pass", "fail", "n/a"


@dataclass
class CheckResult:
    check: str  # stable check name, e.g. "tokens" (used in expectation files as "<scenario>/<check>")
    status: str  # PASS | FAIL | NA
    summary: str  # one line
    report: str = ""  # the full explanation of a failure, for a reader who never saw the code
    request_id: str | None = None  # the request the failure is about, when there is one
    details: dict = field(default_factory=dict)  # JSON-safe facts (first divergence, step, ...)

    @property
    def failed(self) -> bool:
        return self.status == FAIL


def passed(check: str, summary: str) -> CheckResult:
    return CheckResult(check, PASS, summary)


def not_applicable(check: str, summary: str) -> CheckResult:
    return CheckResult(check, NA, summary)


def failed(
    check: str, summary: str, report: str = "", request_id: str | None = None, **details
) -> CheckResult:
    return CheckResult(check, FAIL, summary, report or summary, request_id, details)


@dataclass
class ScenarioResult:
    scenario_id: str
    description: str
    tier: str
    engine: str  # the engine selection as given (name or import path)
    model: str  # checkpoint label
    settings: str  # the engine configuration in words
    checks: list[CheckResult] = field(default_factory=list)
    duration_s: float = 0.0
    skipped: str | None = None  # why the scenario does not apply (e.g. the model has no MTP head)
    error: str | None = None  # the harness or the reference engine broke: an infrastructure error
    replay: str = ""  # command that reruns the whole scenario
    # failing checks an expectations file lists -> reason
    expected: dict[str, str] = field(default_factory=dict)
    stale: list[str] = field(default_factory=list)  # listed "<scenario>/<check>" entries that did not fail
    stale_fails: bool = False  # strict expectations: a stale entry fails the scenario (else a warning)
    dtype: str = "float32"  # what both engines ran in
    features: list[str] = field(default_factory=list)  # the adapter features the scenario needs (FEATURES)
    skip_fails: bool = False  # a skip that the run refuses (--fail-on-skip, a required feature): a failure
    family: str = ""  # the model family (refengine.model.registry) of the checkpoint
    # How its tokens were judged (conformance.verdict): "exact", or "rescored" by the reference in
    # ``reference_dtype`` within ``tolerance`` nats (``dtype`` is then the engine under test's)
    verdict: str = "exact"
    reference_dtype: str = ""  # "" : the run's dtype (exact)
    tolerance: float | None = None
    # The model as the run named it (--model: "tiny:llama", a folder, a hub id; "" for the embedded default),
    # which an outside engine's adapter may have resolved to a checkpoint of its own (``model`` names that)
    model_name: str = ""

    @property
    def judged_by(self) -> str:
        """The verdict in words, as the reports say it."""
        if self.verdict != "rescored":
            return "exact (tokens, drafts and logits bitwise the reference's)"
        return (f"rescored by the reference in {self.reference_dtype or self.dtype} (a token more than "
                f"{self.tolerance:.4g} nats below its pick is structural)")

    @property
    def gaps(self) -> list[dict]:
        """What the scenario ran without exercising (a trigger missed, a request whose parameters changed
        nothing, where the checkpoint decides): ``{"check", "what", "why"}`` each, from the checks that said
        so (``details["gaps"]``; a result of before them: ``details["not_exercised"]`` and its reasons)."""
        out = []
        for c in self.checks:
            if c.failed:
                continue
            named = c.details.get("gaps")
            if named is None:
                reasons = c.details.get("reasons") or {}
                named = [{"what": str(t), "why": reasons.get(t, "")}
                         for t in c.details.get("not_exercised", ())]
            out += [{"check": c.check, "what": g.get("what", ""), "why": g.get("why", "")} for g in named]
        return out

    @property
    def failures(self) -> list[CheckResult]:
        return [c for c in self.checks if c.failed]

    @property
    def unexpected_failures(self) -> list[CheckResult]:
        return [c for c in self.failures if c.check not in self.expected]

    @property
    def ok(self) -> bool:
        return self.error is None and not self.failures

    @property
    def outcome(self) -> str:
        """The verdict once the expectations are applied, as pytest reports it: "pass", "fail",
        "xfail" (every failing check is listed as expected), "skip" or "error" (infrastructure). A skip the
        run refuses (``skip_fails``) is "fail"."""
        if self.skipped:
            return "fail" if self.skip_fails else "skip"
        if self.error:
            return "error"
        if self.unexpected_failures or (self.stale and self.stale_fails):
            return "fail"
        return "xfail" if self.failures else "pass"

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def failed_checks(self) -> list[str]:
        """The checks whose failure fails the scenario (listed expected failures left out)."""
        return [c.check for c in self.unexpected_failures]

    @classmethod
    def from_dict(cls, d: dict) -> ScenarioResult:
        return cls(**{**d, "checks": [CheckResult(**c) for c in d["checks"]]})
