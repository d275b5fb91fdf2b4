"""Expected failures per engine: ``"<scenario-id>/<check>" = "reason"`` entries in a TOML file.

The file for an engine named ``async`` is ``conformance/expectations/async.toml`` (``async:full``
looks for ``async-full.toml`` first); any engine can point at its own with
``--conformance-xfail-file`` / ``--xfail-file``. A check listed there that fails is reported as an
expected failure; one that no longer fails is *stale*: it is named in a warning so the entry gets
removed (or fails the run under ``--conformance-strict-expectations``).

An entry can hold for one checkpoint or one model family only: ``[models."<label>".expected-failures]``
(the checkpoint as the run names it, ``--model``: ``tiny:llama``, a folder, or the label reports give it) and
``[families.<family>.expected-failures]`` tables hold entries of the same form, which apply, beside the
top-level ``[expected-failures]`` ones, only to scenarios run on that checkpoint or family. A divergence an
engine shows on one model is then neither excused on the others nor reported stale there.
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


SCOPES = ("models", "families")


@dataclass(frozen=True)
class Expectations:
    source: str | None = None
    entries: dict[str, str] = field(default_factory=dict)  # "<scenario>/<check>" -> reason, on every model
    # (scope, name) -> entries that hold only there: ("models", "tiny:llama"), ("families", "nemotron_h")
    scoped: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)

    def for_scenario(self, scenario_id: str, models: tuple[str, ...] = (),
                     family: str | None = None) -> dict[str, str]:
        """check -> reason for one scenario run on a checkpoint of ``family`` that ``models`` name (the
        report's label, the name the run was given)."""
        prefix = scenario_id + "/"
        out = {}
        named = [self.scoped.get(("models", m)) for m in dict.fromkeys(models) if m]
        for entries in (self.entries, self.scoped.get(("families", family or "")), *named):
            out.update({k[len(prefix):]: v for k, v in (entries or {}).items() if k.startswith(prefix)})
        return out

    def all_keys(self) -> list[str]:
        """Every "<scenario>/<check>" key, whichever scope holds it."""
        return [*self.entries, *(k for entries in self.scoped.values() for k in entries)]

    def count(self) -> int:
        return len(self.all_keys())


def _entries(path: Path, where: str, table) -> dict[str, str]:
    if not isinstance(table, dict) or any(not isinstance(v, str) for v in table.values()):
        raise ExpectationError(f"{path}: [{where}] must map \"<scenario>/<check>\" to a reason string")
    bad = [k for k in table if k.count("/") != 1]
    if bad:
        raise ExpectationError(f"{path}: entry {bad[0]!r} in [{where}] is not \"<scenario-id>/<check>\"")
    return dict(table)


def load_expectations(path: str | Path) -> Expectations:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ExpectationError(f"cannot read expectations file {path}: {e}") from e
    unknown = sorted(set(data) - {TABLE, *SCOPES})
    if unknown:
        raise ExpectationError(f"{path}: unknown table [{unknown[0]}] (expected [{TABLE}], "
                               f"[models.\"<label>\".{TABLE}] or [families.<family>.{TABLE}])")
    scoped = {}
    for scope in SCOPES:
        names = data.get(scope, {})
        if not isinstance(names, dict):
            raise ExpectationError(f"{path}: [{scope}] must hold one table per name")
        for name, tables in names.items():
            where = f'{scope}."{name}".{TABLE}'
            if not isinstance(tables, dict) or set(tables) != {TABLE}:
                raise ExpectationError(f"{path}: [{scope}.\"{name}\"] must hold exactly [{where}]")
            scoped[(scope, name)] = _entries(path, where, tables[TABLE])
    return Expectations(str(path), _entries(path, TABLE, data.get(TABLE, {})), scoped)


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
    for key in exp.all_keys():
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
    listed = exp.for_scenario(result.scenario_id, (result.model, result.model_name), result.family)
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
