"""JUnit XML -> markdown summary, with new / fixed / still-failing against a baseline file.

  python ci/summarize_junit.py reports/*.xml --baseline ci/nightly-baseline.txt --output summary.md
  python ci/summarize_junit.py reports/tests.xml --write-baseline ci/nightly-baseline.txt

The baseline lists the ids ("<classname>::<name>") of tests known to fail, one per line, "#" for
comments. Failures are classified by what failed, never by words in a traceback (an
infrastructure error's traceback may well contain "AssertionError"):

1. the failure's declared type: the failure element's ``type`` attribute, or the ``failure_type``
   property conformance.plugin records: ConformanceMismatch -> "mismatch", InfrastructureError ->
   "infrastructure";
2. else the failure's crash line (the ``message`` attribute's first line, which pytest fills with the
   exception's type and text): a conformance mismatch or an assertion is a real failure
   ("mismatch"); an InfrastructureError, out-of-memory, timeout, crashed worker, lost connection
   or full disk is "infrastructure" (the only kind the nightly may rerun);
3. anything else is "other" (a real failure, never rerun).

A test that pytest-rerunfailures ran more than once leaves a result-less ``<testcase>`` per earlier
attempt (a nameless one for an attempt whose xdist worker crashed); only its final attempt is kept.

A file that is missing, empty or not JUnit XML (the job ended before writing it) is one line on stderr
and a note in the summary, never a traceback; the other files are still summarized. A run-level error
of the conformance suite (``conformance::gate``, ``conformance::interrupted``: the gate failed, possibly
before any scenario ran, or the run was interrupted) is named with its reason at the top.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from junitparser import Error, Failure, JUnitXml, Properties, Skipped, TestCase

MISMATCH, INFRASTRUCTURE, OTHER = "mismatch", "infrastructure", "other"
FAILING = ("failed", "error")
# Declared failure types (conformance.plugin records them as the ``failure_type`` property).
DECLARED = {"ConformanceMismatch": MISMATCH, "InfrastructureError": INFRASTRUCTURE}
FAILURE_TYPE_PROPERTY = "failure_type"
# JUnit result elements and their outcomes, first match wins.
RESULTS = ((Failure, "failed"), (Error, "error"), (Skipped, "skipped"))
MISMATCH_LINE = re.compile(r"^(?:Failed: )?CONFORMANCE MISMATCH|^assert\b|^AssertionError\b")
# Exception types (last dotted component) of failures that say nothing about the code under test.
INFRA_TYPES = frozenset({
    "InfrastructureError", "OutOfMemoryError", "MemoryError", "TimeoutError", "Timeout", "ConnectionError",
    "ConnectionResetError", "BrokenPipeError", "NcclError", "DistNetworkError",
})
# Crash lines without an exception type of their own (or a generic one) that are infrastructure.
INFRA_LINE = re.compile(
    r"CUDA out of memory|CUDA error|NCCL|worker '?gw\d+'? crashed|node down|No space left on device"
    r"|Cannot allocate memory|Fatal Python error|Killed|Timeout"
)
EXCEPTION_TYPE = re.compile(r'^(?:failed on (?:setup|teardown) with ")?([A-Za-z_][\w.]*)(?::|"?$)')


def classify(message: str, failure_type: str | None = None) -> str:
    """mismatch | infrastructure | other, from the declared type or else the crash line."""
    if failure_type in DECLARED:
        return DECLARED[failure_type]
    line = message.strip().splitlines()[0] if message.strip() else ""
    if MISMATCH_LINE.search(line):
        return MISMATCH
    m = EXCEPTION_TYPE.match(line)
    exc = m.group(1).rsplit(".", 1)[-1] if m else None
    if exc in INFRA_TYPES or INFRA_LINE.search(line):
        return INFRASTRUCTURE
    return MISMATCH if exc == "AssertionError" else OTHER


@dataclass
class Case:
    id: str  # "<classname>::<name>", xdist group suffix removed
    outcome: str  # passed | failed | error | skipped | xfailed
    message: str = ""
    text: str = ""
    seconds: float = 0.0
    properties: dict[str, str] = field(default_factory=dict)

    failure_type: str | None = None  # the failure element's ``type`` attribute, when the writer set one

    @property
    def kind(self) -> str | None:
        if self.outcome not in FAILING:
            return None
        return classify(
            self.message or self.text, self.failure_type or self.properties.get(FAILURE_TYPE_PROPERTY)
        )


def _result(tc: TestCase) -> tuple[str, Failure | Error | Skipped] | None:
    """The outcome and element of the testcase's failure, else its error, else its skip."""
    results = tc.result
    return next(((outcome, r) for kind, outcome in RESULTS for r in results if isinstance(r, kind)), None)


def _case(tc: TestCase) -> Case:
    name = re.sub(r"@[^\]\[]+$", "", tc.name or "")  # loadgroup's "@group" suffix
    case = Case(f"{tc.classname or ''}::{name}", "passed", seconds=tc.time or 0.0)
    case.properties = {p.name: p.value for p in tc.child(Properties) or ()}
    found = _result(tc)
    if found:
        case.outcome, result = found
        if case.outcome == "skipped" and "xfail" in (result.type or ""):  # pytest writes xfail as a skip
            case.outcome = "xfailed"
        case.message = result.message or ""
        case.failure_type = result.type
        case.text = result.text or ""
    return case


def _final_attempts(cases: list[Case]) -> list[Case]:
    """Drop pytest-rerunfailures' earlier attempts: a result-less case followed by one of the same id."""
    last = {c.id: i for i, c in enumerate(cases)}
    return [c for i, c in enumerate(cases) if c.outcome != "passed" or last[c.id] == i]


def read_junit(paths: list[str | Path]) -> list[Case]:
    """The test cases of JUnit XML files, each test's final attempt only. A nameless result-less
    testcase is the attempt of a crashed xdist worker that pytest-rerunfailures ran again."""
    cases = []
    for path in paths:
        testcases = [tc for suite in JUnitXml.fromfile(str(path)) for tc in suite]
        cases += _final_attempts([_case(tc) for tc in testcases if tc.name or tc.result])
    return cases


def read_reports(paths: list[str | Path]) -> tuple[list[Case], list[str]]:
    """The cases of the files that can be read, and one line for each that cannot (missing, empty, not
    JUnit XML), saying so."""
    cases, problems = [], []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            problems.append(f"{path}: no such file (the job ended before writing it; see its log)")
        elif not p.read_text(errors="replace").strip():
            problems.append(f"{path}: empty (the job ended before writing it; see its log)")
        else:
            try:
                cases += read_junit([p])
            except Exception as e:  # noqa: BLE001 - any parser's error: the file is not JUnit XML
                problems.append(f"{path}: not JUnit XML ({' '.join(str(e).split()) or type(e).__name__})")
    return cases, problems


def run_errors(cases: list[Case]) -> list[str]:
    """The conformance suite's run-level errors (``conformance::gate``, ``conformance::interrupted``)."""
    return [f"**conformance {c.id.split('::', 1)[1]}**: {_first_line(c.message or c.text, 400)}"
            for c in cases if c.id.startswith("conformance::") and c.outcome in FAILING]


def load_baseline(path: str | Path | None) -> set[str]:
    if path is None or not Path(path).is_file():
        return set()
    lines = (line.split("#", 1)[0].strip() for line in Path(path).read_text().splitlines())
    return {line for line in lines if line}


@dataclass
class Comparison:
    new: list[Case]
    still: list[Case]
    fixed: list[str]


def compare(cases: list[Case], baseline: set[str]) -> Comparison:
    failing = [c for c in cases if c.outcome in FAILING]
    ids = {c.id for c in failing}
    seen = {c.id for c in cases}
    return Comparison(new=[c for c in failing if c.id not in baseline],
                      still=[c for c in failing if c.id in baseline],
                      fixed=sorted(b for b in baseline if b in seen and b not in ids))


def _first_line(text: str, limit: int = 160) -> str:
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    line = line.replace("|", "\\|")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _table(cases: list[Case]) -> list[str]:
    rows = ["| test | kind | message | replay |", "|---|---|---|---|"]
    for c in cases:
        replay = c.properties.get("replay", "")
        rows.append(
            f"| `{c.id}` | {c.kind} | {_first_line(c.message or c.text)} | "
            f"{f'`{replay}`' if replay else ''} |"
        )
    return rows


def markdown(
    cases: list[Case], comparison: Comparison, title: str = "Test summary", notes: list[str] = ()
) -> str:
    count = {
        o: sum(c.outcome == o for c in cases) for o in ("passed", "failed", "error", "skipped", "xfailed")
    }
    totals = (f"| {count['passed']} | {count['failed']} | {count['error']} | {count['skipped']} | "
              f"{count['xfailed']} | {len(cases)} |")
    lines = [
        f"## {title}",
        "",
        "| passed | failed | errors | skipped | xfailed | total |",
        "|---|---|---|---|---|---|",
        totals,
        "",
    ]
    lines += [f"- {n}" for n in notes]
    if notes:
        lines.append("")
    for heading, group in (
        ("New failures", comparison.new),
        ("Still failing (in the baseline)", comparison.still),
    ):
        lines += [f"### {heading}: {len(group)}", ""]
        lines += (_table(group) if group else ["none"]) + [""]
    lines += [f"### Fixed (in the baseline, now passing): {len(comparison.fixed)}", ""]
    lines += [f"- `{i}`" for i in comparison.fixed] or ["none"]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("junit", nargs="+", help="JUnit XML files")
    p.add_argument("--baseline", default=None, help="file of known-failing test ids")
    p.add_argument("--output", default=None, help="write the markdown here (default: stdout)")
    p.add_argument("--title", default="Test summary")
    p.add_argument(
        "--write-baseline", default=None, metavar="FILE", help="write the current failures as a baseline"
    )
    p.add_argument("--fail-on-new", action="store_true", help="exit 1 when a failure is not in the baseline")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    cases, problems = read_reports(args.junit)
    for line in problems:
        print(f"summarize_junit: {line}", file=sys.stderr)
    comparison = compare(cases, load_baseline(args.baseline))
    notes = run_errors(cases) + [f"`{line}`" for line in problems]
    text = markdown(cases, comparison, args.title, notes=notes)
    if args.output:
        Path(args.output).write_text(text)
    else:
        print(text)
    if args.write_baseline:
        ids = sorted({c.id for c in cases if c.outcome in FAILING})
        Path(args.write_baseline).write_text(
            "# Known failures (ids from ci/summarize_junit.py), one per line.\n"
            + "".join(f"{i}\n" for i in ids)
        )
    return 1 if args.fail_on_new and comparison.new else 0


if __name__ == "__main__":
    sys.exit(main())
