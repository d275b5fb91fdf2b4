"""``conformance calibrate``: the tolerances of ``--verdict rescored``, measured on this project's engines.

Each engine (``reference`` and ``async``) runs the corpus in each engine dtype on every family's model, and
the reference engine scores its output (``conformance.scoring``) in each reference dtype. Every scored
position's margin (nats below the reference's pick) is recorded per (engine dtype, reference dtype) pair
and family: how many positions were scored, how many diverged, the largest margin, where it was, and the
quantiles of the non-zero margins. A pair's tolerance is its largest margin over every family and engine
times ``HEADROOM``: these engines are correct, so what they show is numerics alone (a near-tie flipped by
rounding), and a token further below the reference's pick than that is not.

The engine dtype against float32 measures what the engine's dtype costs. Against the reference in the
engine's own dtype this project's engines are bitwise (margin 0 everywhere), so there the reference scores
with its other prefill kernel (the chunked form of the recurrent mixers, ``recurrent_prefill_chunked``)
than the recurrent form the engines decode with: the kernel-shape noise of one dtype, as an engine with
other kernels shows it.

The table is ``conformance/calibration.json`` (shipped; ``--out`` writes another). Subsets (``--families``,
``--scenarios``, ``--dtypes``) regenerate part of it, e.g. for a quick look; the shipped one is the whole
default tier on every family.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from conformance.verdict import CALIBRATION_FILE, CALIBRATION_FORMAT, pair_key

HEADROOM = 2.0  # tolerance = the largest margin the own engines showed x this
ENGINES = ("reference", "async")
ENGINE_DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_MODELS = ("default", "tiny:nemotron_h", "tiny:llama", "tiny:qwen3")  # every registered family
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class Tally:
    """The margins of one (pair, family): every scored position's, kept as the non-zero ones."""

    positions: int = 0
    scenarios: set = field(default_factory=set)
    nonzero: list = field(default_factory=list)  # [margin] of the diverging positions
    worst: dict | None = None  # where the largest margin was

    def add(self, margin: float, where: dict) -> None:
        self.positions += 1
        if margin > 0:
            self.nonzero.append(margin)
            if self.worst is None or margin > self.worst["margin"]:
                self.worst = {**where, "margin": margin}

    @property
    def max_margin(self) -> float:
        return max(self.nonzero, default=0.0)

    def to_dict(self) -> dict:
        ordered = sorted(self.nonzero)

        def q(p: float) -> float | None:
            return round(ordered[min(len(ordered) - 1, math.floor(p * len(ordered)))], 6) if ordered else None

        return {"scenarios": len(self.scenarios), "positions": self.positions,
                "divergences": len(self.nonzero),
                "max_margin": round(self.max_margin, 6), "worst": self.worst,
                "nonzero_quantiles": {f"p{round(p * 100)}": q(p) for p in QUANTILES}}


def pairs_of(dtypes) -> list[tuple[str, str]]:
    """(engine dtype, reference dtype) pairs calibrated: each against float32, and against itself."""
    out = []
    for d in dtypes:
        out += [(d, "float32")] + ([(d, d)] if d != "float32" else [])
    return out


def calibrate(models=DEFAULT_MODELS, scenarios=None, dtypes=ENGINE_DTYPES, engines=ENGINES, tier="default",
              device: str = "cpu", log=print, progress=None) -> dict:
    """The calibration table (see the module's docstring) over ``models`` ("default": the embedded default
    model), ``scenarios`` (None: the whole ``tier``), engine ``dtypes`` and ``engines``. ``progress``: called
    with the table so far after each engine and dtype (a long run keeps what it measured)."""
    from conformance.adapters.refengine import RefEngineAdapter
    from conformance.harness import Case, run_workload, skip_reason
    from conformance.model import preflight
    from conformance.scoring import Scorer, score_trace
    from conformance.workloads import get_def, scenario_ids
    from refengine.config import DEFAULT_ASYNC_GRAPH_MODE

    tallies: dict[tuple[str, str], dict[str, Tally]] = {}
    ids = list(scenarios) if scenarios else scenario_ids(tier)
    for model in models:
        arg = None if model == "default" else model
        facts = preflight(arg, device, "float32")
        family = f"{facts.family} ({'embedded default model' if arg is None else arg})"
        scorers = {}
        for engine in engines:
            adapter = RefEngineAdapter(engine, "none" if engine == "reference" else DEFAULT_ASYNC_GRAPH_MODE)
            for dtype in dtypes:
                started, scored = time.perf_counter(), 0
                case = Case(engine, adapter, facts, arg, tier, device, dtype)
                for sid in ids:
                    scenario = get_def(sid).materialize(tier, facts.vocab_size)
                    if skip_reason(scenario, case) or all(r.samples for r in scenario.requests):
                        continue
                    trace = run_workload(case.adapter_for(scenario), scenario, facts, label=engine,
                                         device=device, dtype=dtype)
                    if trace.error is not None:
                        raise RuntimeError(f"{engine} in {dtype} on {family} failed {sid}:\n{trace.error}")
                    for d, ref in pairs_of([dtype]):
                        chunked = ref == d  # bitwise against itself: the other prefill kernel scores
                        key = (ref, chunked)
                        if key not in scorers:
                            scorers[key] = Scorer(facts.path, ref, device, chunked=chunked)
                        tally = tallies.setdefault((d, ref), {}).setdefault(family, Tally())
                        tally.scenarios.add(sid)
                        for rid, s in score_trace(scorers[key], trace, scenario).items():
                            for i, m in enumerate(s.margins):
                                tally.add(m, {"engine": engine, "scenario": sid, "request": rid,
                                              "position": i, "token": s.tokens[i],
                                              "reference_pick": s.argmax[i]})
                    scored += 1
                log(f"  {family}: {engine} in {dtype}: {scored} scenarios scored in "
                    f"{time.perf_counter() - started:.1f} s", flush=True)
                if progress is not None:
                    progress(build_table(tallies, tier, engines))
    return build_table(tallies, tier, engines)


def build_table(tallies: dict, tier: str, engines) -> dict:
    """The table from the tallies: per pair its tolerance (max margin x HEADROOM) and per-family figures."""
    pairs = {}
    for (d, ref), by_family in sorted(tallies.items()):
        worst = round(max((t.max_margin for t in by_family.values()), default=0.0), 6)
        pairs[pair_key(d, ref)] = {
            "tolerance": round(worst * HEADROOM, 6),
            "max_margin": worst,
            "positions": sum(t.positions for t in by_family.values()),
            "divergences": sum(len(t.nonzero) for t in by_family.values()),
            "scoring": ("the reference's chunked prefill kernels (the engines decode with the recurrent form)"
                        if d == ref else "the engines' own kernels, in the reference dtype"),
            "families": {f: t.to_dict() for f, t in sorted(by_family.items())},
        }
    return {"format": CALIBRATION_FORMAT, "headroom": HEADROOM,
            "rule": "tolerance = the largest margin (nats) over every family and engine x headroom",
            "engines": list(engines), "tier": tier, "created": time.strftime("%Y-%m-%d"),
            "command": _command(), "pairs": pairs}


def _command() -> str:
    """The command that made the table (this process's, when it is ``conformance calibrate``)."""
    if sys.argv[1:2] == ["calibrate"]:
        return shlex.join(["conformance", "calibrate", *sys.argv[2:]])
    return "conformance calibrate"


def format_table(table: dict) -> str:
    """The table in words: one line per pair and family."""
    head = (f"calibration (headroom x{table['headroom']}, engines {', '.join(table['engines'])}, tier "
            f"{table['tier']}):")
    lines = [head]
    for key, p in table["pairs"].items():
        lines.append(f"  {key}: tolerance {p['tolerance']:.4g} nats (max margin {p['max_margin']:.4g} over "
                     f"{p['positions']} positions, {p['divergences']} divergences; scored with "
                     f"{p['scoring']})")
        for family, f in p["families"].items():
            q = f["nonzero_quantiles"]
            lines.append(f"    {family}: {f['scenarios']} scenarios, {f['positions']} positions, "
                         f"{f['divergences']} divergences, max {f['max_margin']:.4g}"
                         + (f" (p50 {q['p50']:.3g}, p90 {q['p90']:.3g})" if f["divergences"] else ""))
    return "\n".join(lines)


def write_table(table: dict, path: str | Path | None = None) -> Path:
    path = Path(path) if path is not None else CALIBRATION_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return path
