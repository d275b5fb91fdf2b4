"""Expected failures per engine: ``"<scenario-id>/<check>" = "reason"`` entries in a TOML file.

The file for an engine named ``async`` is ``conformance/expectations/async.toml`` (``async:full``
looks for ``async-full.toml`` first); any engine can point at its own with
``--conformance-xfail-file`` / ``--xfail-file``. A check listed there that fails is reported as an
expected failure; one that no longer fails is *stale*: it is named in a warning so the entry gets
removed (or fails the run under ``--conformance-strict-expectations``).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

from conformance.results import ScenarioResult

TABLE = "expected-failures"
ANY_CHECK = "*"


class ExpectationError(ValueError):
    pass


@dataclass(frozen=True)
class Expectations:
    source: str | None = None
    entries: dict[str, str] = field(default_factory=dict)  # "<scenario>/<check>" -> reason

    def for_scenario(self, scenario_id: str) -> dict[str, str]:
        prefix = scenario_id + "/"
        return {k[len(prefix):]: v for k, v in self.entries.items() if k.startswith(prefix)}


def load_expectations(path: str | Path) -> Expectations:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ExpectationError(f"cannot read expectations file {path}: {e}") from e
    table = data.get(TABLE, {})
    if not isinstance(table, dict) or any(not isinstance(v, str) for v in table.values()):
        raise ExpectationError(f"{path}: [{TABLE}] must map \"<scenario>/<check>\" to a reason string")
    bad = [k for k in table if k.count("/") != 1]
    if bad:
        raise ExpectationError(f"{path}: entry {bad[0]!r} is not \"<scenario-id>/<check>\"")
    return Expectations(str(path), dict(table))


def expectations_file_for(engine: str) -> Path | None:
    """The packaged expectations file for a built-in engine name, if there is one."""
    folder = files("conformance") / "expectations"
    names = [re.sub(r"[^A-Za-z0-9_.-]+", "-", engine) + ".toml"]
    if ":" in engine:
        names.append(engine.split(":", 1)[0] + ".toml")
    for name in names:
        candidate = folder / name
        if candidate.is_file():
            return Path(str(candidate))
    return None


def unknown_entries(exp: Expectations, scenario_ids: list[str], check_names: tuple[str, ...]) -> list[str]:
    """Entries naming a scenario or check that does not exist (typos that would never match)."""
    out = []
    for key in exp.entries:
        sid, check = key.split("/")
        if sid not in scenario_ids or (check != ANY_CHECK and check not in check_names):
            out.append(key)
    return out


@dataclass
class Verdict:
    outcome: str  # "pass" | "fail" | "xfail" | "skip" | "error"
    unexpected: list[str]  # failing checks not listed as expected
    expected: dict[str, str]  # failing checks listed as expected -> reason
    stale: list[str]  # listed "<scenario>/<check>" keys that did not fail

    def stale_message(self, source: str | None) -> str:
        return (f"stale expected failure(s) in {source}: {', '.join(self.stale)} no longer fail; "
                "remove them from the file")


def judge(result: ScenarioResult, exp: Expectations) -> Verdict:
    listed = exp.for_scenario(result.scenario_id)
    failing = [c.check for c in result.failures]
    if result.skipped:
        return Verdict("skip", [], {}, [])
    if result.error:
        return Verdict("error", [], {}, [])
    expected = {
        c: listed.get(c, listed.get(ANY_CHECK, "")) for c in failing if c in listed or ANY_CHECK in listed
    }
    unexpected = [c for c in failing if c not in expected]
    stale = [f"{result.scenario_id}/{c}" for c in listed if c != ANY_CHECK and c not in failing]
    if ANY_CHECK in listed and not failing:
        stale.append(f"{result.scenario_id}/{ANY_CHECK}")
    outcome = "fail" if unexpected else "xfail" if expected else "pass"
    return Verdict(outcome, unexpected, expected, stale)
