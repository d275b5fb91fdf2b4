"""Settings shared by the CLI and the pytest plugin: which engine, model, tier and device.

Importing it imports neither torch nor refengine (the pytest plugin reads its names in every pytest run
of an environment holding the package): the engines, the harness and the model load when a selection
is opened or checked."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conformance.expectations import Expectations, expectations_file_for, load_expectations
from conformance.watchdog import DEFAULT_STEP_TIMEOUT
from conformance.workloads import TIERS, UnknownScenario, scenario_ids
from conformance.workloads.scenario import EAGLE_DRAFTERS, MAMBA_CACHE_MODES

if TYPE_CHECKING:
    from conformance.api import EngineAdapter
    from conformance.harness import Case

DEFAULT_ENGINE = "async"  # the engine under test unless --engine / CONFORMANCE_ENGINE says otherwise
ENV_ENGINE = "CONFORMANCE_ENGINE"
ENV_MODEL = "CONFORMANCE_MODEL"
ENV_DEVICE = "CONFORMANCE_DEVICE"
ENV_DTYPE = "CONFORMANCE_DTYPE"
DEFAULT_DTYPE = "float32"  # both engines' dtype unless --dtype / CONFORMANCE_DTYPE names one


def resolve_engine(name: str) -> EngineAdapter:
    """Any engine name: those ``load_engine`` knows, and ``mutant:<id>`` (the async engine with one
    seed bug re-created, see ``conformance.mutants``)."""
    from conformance.adapters import load_engine
    from conformance.api import UnknownEngine

    if name.startswith("mutant:"):
        from conformance.mutants import MutantAdapter, get_mutant

        try:
            return MutantAdapter(get_mutant(name.partition(":")[2]))
        except KeyError as e:
            raise UnknownEngine(str(e.args[0])) from None
    return load_engine(name)


def pick(option: str | None, env_var: str, default: str | None) -> str | None:
    """An explicit option wins, then the environment variable, then the default."""
    if option:
        return option
    return os.environ.get(env_var) or default


@dataclass(frozen=True)
class Selection:
    engine: str = DEFAULT_ENGINE
    model: str | None = None  # None: the embedded default model
    tier: str = "default"
    device: str = "cpu"
    xfail_file: str | None = None  # None: the engine's packaged expectations file, if any
    dtype: str = DEFAULT_DTYPE  # both engines; "auto": the checkpoint's own dtype
    enable_prefix_caching: bool = False  # every scenario with prefix caching for the engine under test
    mamba_cache_mode: str | None = None  # with it: "align" | "all" (None: each scenario's own, else align)
    step_timeout: float | None = DEFAULT_STEP_TIMEOUT  # seconds one engine call may take before it fails
    allow_unexercised: bool = False  # a trigger a scenario misses is a warning, not a failure
    drafter: str | None = None  # every speculating scenario with this drafter (None: each its own)
    draft_model: str | None = None  # with drafter "draft_model": its checkpoint folder or "cut:<layers>"
    tensor_parallel_size: int = 1  # the engine under test's tensor-parallel ranks (an outside engine's TP)
    # How its tokens are judged (conformance.verdict): "exact" | "rescored" | "auto"; the reference's dtype
    # and device under "rescored" (None: the run's), and nats instead of the calibrated tolerance (None:
    # calibrated)
    verdict: str = "exact"
    reference_dtype: str | None = None
    reference_device: str | None = None
    tolerance: float | None = None
    # A trigger or bound a checkpoint decides, missed, fails instead of being "not exercised" (a warning and
    # a named gap): the gate of a run on the models the corpus is tuned to (--require-exercised)
    require_exercised: bool = False

    def __post_init__(self):
        if self.tier not in TIERS:
            raise ValueError(f"unknown tier {self.tier!r}; choose one of {', '.join(TIERS)}")
        from refengine.config import DTYPE_CHOICES

        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.reference_dtype is not None and self.reference_dtype not in DTYPE_CHOICES:
            raise ValueError(f"reference dtype must be one of {', '.join(DTYPE_CHOICES)}, got "
                             f"{self.reference_dtype!r}")
        from conformance.verdict import VERDICTS

        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}, got {self.verdict!r}")
        if self.mamba_cache_mode is not None and self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(f"mamba cache mode must be one of {', '.join(MAMBA_CACHE_MODES)}, "
                             f"got {self.mamba_cache_mode!r}")
        if self.require_exercised and self.allow_unexercised:
            raise ValueError("--require-exercised asks for every trigger, --allow-unexercised lets a "
                             "missed one warn: give one of them")
        if self.step_timeout is not None and not self.step_timeout > 0:
            raise ValueError(f"step timeout must be > 0 seconds, got {self.step_timeout}")
        if self.mamba_cache_mode is not None and not self.enable_prefix_caching:
            raise ValueError(f"a mamba cache mode ({self.mamba_cache_mode}) needs prefix caching enabled "
                             "(--enable-prefix-caching)")
        if (self.drafter == "draft_model" and self.draft_model is None) or (
                self.draft_model is not None and self.drafter not in ("draft_model", *EAGLE_DRAFTERS)):
            raise ValueError(f"--draft-model goes with --drafter draft_model, which needs one, or --drafter "
                             f"eagle|eagle3 (got --drafter {self.drafter}, --draft-model {self.draft_model})")

    def open_case(self) -> Case:
        """Load the adapter and describe the model (raises for unknown engines or missing models)."""
        from conformance.harness import Case
        from conformance.model import preflight, run_dtype

        adapter = resolve_engine(self.engine)
        model = self.model
        resolve = getattr(adapter, "resolve_model", None)
        if callable(resolve):  # an outside engine's own geometry of a tiny:* preset (adapters/vllm.py)
            model = resolve(model)
        facts = preflight(model, self.device, self.dtype)
        check = getattr(adapter, "check_model", None)
        if callable(check):  # refuses a checkpoint it cannot load, in one line, before any work
            check(facts.path, run_dtype(self.dtype, facts))
        return Case(
            self.engine,
            adapter,
            facts,
            self.model,
            self.tier,
            self.device,
            run_dtype(self.dtype, facts),
            self.enable_prefix_caching,
            self.mamba_cache_mode,
            self.step_timeout,
            self.allow_unexercised,
            drafter=self.drafter,
            draft_model=self.draft_model,
            tensor_parallel_size=self.tensor_parallel_size,
            verdict=self.verdict,
            reference_dtype=None if self.reference_dtype is None else run_dtype(self.reference_dtype, facts),
            reference_device=self.reference_device,
            tolerance=self.tolerance,
            require_exercised=self.require_exercised,
        )

    def expectations(self) -> Expectations:
        path = self.xfail_file or expectations_file_for(self.engine)
        return load_expectations(path) if path else Expectations()


def select_scenarios(tier: str, wanted: list[str], files: list[str]) -> list[str]:
    """What a run parametrises over: the ``wanted`` ids of ``tier`` (default: all of them, unless only
    scenario files are named), then the ``files``. Raises UnknownScenario for an id not in the tier
    and ScenarioFileError (a ValueError) for a file that is missing or not a scenario file."""
    from conformance.workloads.files import ScenarioFileError, read_scenario_file

    known = scenario_ids(tier)
    unknown = [sid for sid in wanted if sid not in known]
    if unknown:
        elsewhere = [t for t in TIERS if t != tier and unknown[0] in scenario_ids(t)]
        if elsewhere:
            raise UnknownScenario(f"scenario {unknown[0]!r} is in the {elsewhere[0]} tier, not in {tier!r}: "
                                  f"add --tier {elsewhere[0]}")
        raise UnknownScenario(
            f"scenario {unknown[0]!r} is not in tier {tier!r}; `conformance list` shows the ids"
        )
    from conformance.checks.triggers import unknown_trigger

    for f in files:
        try:
            scenario = read_scenario_file(f, None, tier)  # the format; the vocabulary once the model is known
        except OSError as e:
            raise ScenarioFileError(f"cannot read scenario file {f}: {e.strerror or e}") from None
        unknown = unknown_trigger(scenario.triggers)
        if unknown:
            raise ScenarioFileError(f"{f}: triggers: {unknown}")
    return [*(wanted or ([] if files else known)), *files]
