"""The workload corpus: named scenarios with stable ids, materialised per tier and model."""

from __future__ import annotations

from conformance.workloads.corpus import scenario_defs
from conformance.workloads.scenario import (
    PATTERNS,
    TIERS,
    EngineSettings,
    RequestSpec,
    Scenario,
    ScenarioDef,
    seed_of,
)


class UnknownScenario(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def scenario_ids(tier: str = "default") -> list[str]:
    """The ids of a tier's scenarios, sorted (the same list on every machine and xdist worker)."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; choose one of {TIERS}")
    return [d.id for d in scenario_defs() if tier in d.tiers]


def get_def(scenario_id: str) -> ScenarioDef:
    for d in scenario_defs():
        if d.id == scenario_id:
            return d
    raise UnknownScenario(
        f"unknown scenario {scenario_id!r}; `conformance list --tier nightly` shows every id"
    )


def load_scenario(scenario_id: str, tier: str, vocab_size: int) -> Scenario:
    return get_def(scenario_id).materialize(tier, vocab_size)


def file_scenario(path, vocab_size: int | None, tier: str) -> Scenario:
    """The scenario of a scenario file as a run names it: a file's scenario never takes a corpus scenario's
    id (reports, expectations and replays would take it for that scenario), so one reusing a corpus id is
    named ``<id>@<file name>``."""
    from dataclasses import replace
    from pathlib import Path

    from conformance.workloads.files import read_scenario_file

    scenario = read_scenario_file(path, vocab_size, tier)
    if scenario.id in {d.id for d in scenario_defs()}:
        name = f"{scenario.id}@{Path(path).name}"
        return replace(scenario, id=name, description=f"{scenario.description} (scenario file {path}, whose "
                       f"id {scenario.id!r} is a corpus scenario's)".lstrip())
    return scenario


__all__ = [
    "PATTERNS", "TIERS", "EngineSettings", "RequestSpec", "Scenario", "ScenarioDef", "UnknownScenario",
    "file_scenario", "get_def", "load_scenario", "scenario_defs", "scenario_ids", "seed_of",
]
