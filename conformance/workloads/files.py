"""Scenario files: one materialised workload as JSON, for replays and the regression corpus.

A shrunk failing workload from ``conformance fuzz`` is written as such a file; ``conformance run
--scenario-file F`` and ``conformance replay --scenario-file F`` run it, and every file in
``conformance/workloads/regressions/`` joins both tiers of the corpus under its ``id``.

Format (``"format": "conformance-scenario/1"``)::

    {"format": "conformance-scenario/1", "id": "...", "description": "...",
     "settings": {EngineSettings fields}, "graph_mode": null | "none" | "piecewise" | "full" | ...,
     "vocab_size": 260,                      # the vocabulary the token ids were drawn for
     "requests": [{"request_id": "r00", "prompt": [ids], "max_tokens": 8, "arrival_step": 0,
                   "ignore_eos": true, "stop_token_ids": [], "abort_step": null,
                   "extends": null,              # or an earlier request's id: a next turn (see RequestSpec)
                   "params": {}}, ...],          # SamplingParams fields, vLLM's names (REQUEST_PARAMS):
                                                 # {"allowed_token_ids": [ids], "logit_bias": {"id": bias},
                                                 #  "min_tokens": 4, "stop": ["ab"], "logprobs": 2, ...}
     "origin": {...}}                        # where it came from (seed, failing check): informational

Token ids are exact when the model's vocabulary is the file's; on a smaller vocabulary they are
taken modulo its size (the workload keeps its shape: lengths, arrivals, aborts, budgets).
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

from conformance.workloads.scenario import TIERS, EngineSettings, RequestSpec, Scenario, ScenarioDef

FORMAT = "conformance-scenario/1"
GRAPH_MODES = ("none", "piecewise", "full", "full_and_piecewise")
REGRESSIONS_DIR = Path(__file__).with_name("regressions")


class ScenarioFileError(ValueError):
    pass


def scenario_to_dict(scenario: Scenario, vocab_size: int, origin: dict | None = None) -> dict:
    return {
        "format": FORMAT,
        "id": scenario.id,
        "description": scenario.description,
        "settings": asdict(scenario.settings),
        "graph_mode": scenario.graph_mode,
        "vocab_size": vocab_size,
        "requests": [{**asdict(r), "prompt": list(r.prompt), "stop_token_ids": list(r.stop_token_ids),
                      "params": _params_to_json(r)}
                     for r in scenario.requests],
        "origin": origin or {},
    }


def _params_to_json(r: RequestSpec) -> dict:
    """A request's parameters as JSON: lists, and ``logit_bias`` an object keyed by id."""
    return {name: ({str(t): b for t, b in value} if name == "logit_bias" else
                   list(value) if isinstance(value, tuple) else value) for name, value in r.params}


def _params_from_json(params, vocab_size: int | None) -> dict:
    """A file's ``params`` object; ``vocab_size``: take the ids modulo it (a smaller vocabulary)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ScenarioFileError(
            f"a request's params must be an object of SamplingParams fields, got {params!r}")
    out = dict(params)
    if vocab_size is not None:
        if out.get("allowed_token_ids") is not None:
            out["allowed_token_ids"] = sorted({int(t) % vocab_size for t in out["allowed_token_ids"]})
        if out.get("logit_bias") is not None:
            out["logit_bias"] = {int(t) % vocab_size: b for t, b in dict(out["logit_bias"]).items()}
    return out


def write_scenario_file(
    path: str | Path, scenario: Scenario, vocab_size: int, origin: dict | None = None
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(scenario_to_dict(scenario, vocab_size, origin), indent=1) + "\n")
    return path


def scenario_from_dict(
    d: dict, vocab_size: int | None = None, tier: str = "default", source: str = ""
) -> Scenario:
    """A Scenario from a file's contents; ``vocab_size``: the model's (ids modulo it when smaller)."""
    where = f"{source}: " if source else ""
    if not isinstance(d, dict):
        raise ScenarioFileError(f"{where}not a scenario file (a JSON {type(d).__name__}, expected an object "
                                f"with \"format\": {FORMAT!r})")
    if d.get("format") != FORMAT:
        raise ScenarioFileError(
            f"{where}not a scenario file (format {d.get('format')!r}, expected {FORMAT!r})"
        )
    try:
        known = {f.name for f in fields(EngineSettings)}
        unknown = set(d["settings"]) - known
        if unknown:
            raise ScenarioFileError(f"{where}unknown settings {sorted(unknown)}")
        settings = EngineSettings(**d["settings"])
        graph_mode = d.get("graph_mode")
        if graph_mode is not None and graph_mode not in GRAPH_MODES:
            raise ScenarioFileError(
                f"{where}graph_mode must be null or one of {GRAPH_MODES}, got {graph_mode!r}"
            )
        file_vocab = int(d["vocab_size"])
        remap = vocab_size is not None and vocab_size < file_vocab
        requests = []
        for r in d["requests"]:
            prompt = r["prompt"]
            if not isinstance(prompt, str):
                prompt = tuple(int(t) % vocab_size if remap else int(t) for t in prompt)
            stops = tuple(int(t) % vocab_size if remap else int(t) for t in r.get("stop_token_ids", ()))
            requests.append(RequestSpec(str(r["request_id"]), prompt, int(r["max_tokens"]),
                                        int(r.get("arrival_step", 0)), bool(r.get("ignore_eos", True)), stops,
                                        None if r.get("abort_step") is None else int(r["abort_step"]),
                                        None if r.get("extends") is None else str(r["extends"]),
                                        _params_from_json(r.get("params"), vocab_size if remap else None)))
    except (KeyError, TypeError) as e:
        raise ScenarioFileError(f"{where}malformed scenario file: {type(e).__name__}: {e}") from None
    except ScenarioFileError:
        raise
    except ValueError as e:  # settings or a request the workload cannot hold (an abort before arrival, a bad
        # extends) (an abort before arrival, a bad extends)
        raise ScenarioFileError(f"{where}{e}") from None
    if not requests:
        raise ScenarioFileError(f"{where}the scenario has no requests")
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ScenarioFileError(f"{where}duplicate request ids")
    description = str(d.get("description", ""))
    if remap:
        description += f" (token ids taken modulo {vocab_size}: drawn for a vocabulary of {file_vocab})"
    try:
        return Scenario(
            str(d["id"]),
            description,
            tier,
            settings,
            tuple(requests),
            tuple(d.get("triggers", ())),
            graph_mode,
        )
    except ValueError as e:
        raise ScenarioFileError(f"{where}{e}") from None


def read_scenario_file(path: str | Path, vocab_size: int | None = None, tier: str = "default") -> Scenario:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ScenarioFileError(f"{path}: not JSON: {e}") from None
    return scenario_from_dict(data, vocab_size, tier, str(path))


def regression_defs(directory: Path = REGRESSIONS_DIR) -> list[ScenarioDef]:
    """One ScenarioDef per file of the regression corpus (both tiers, the same requests in each)."""
    defs = []
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        probe = scenario_from_dict(data, source=str(path))  # validate now, not at the first run

        def build(b, data=data, path=path):
            sc = scenario_from_dict(data, b.vocab_size, b.tier, str(path))
            b.requests.extend(sc.requests)

        defs.append(
            ScenarioDef(
                probe.id,
                probe.description or f"regression from {path.name}",
                probe.settings,
                build,
                probe.triggers,
                TIERS,
                ("regression",),
                probe.graph_mode,
            )
        )
    return defs
