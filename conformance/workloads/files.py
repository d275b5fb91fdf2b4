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

Every key is validated as API input before any work (``validate``: one rule per key, ``SETTINGS_RULES``,
``REQUEST_RULES``, ``FILE_RULES``): its type and range, token ids inside the file's ``vocab_size``, no
empty prompt (a next turn's own tokens may be none), and an unknown key is named with the nearest known
one. Each problem is one ``ScenarioFileError`` line.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from conformance.workloads.scenario import (
    DRAFTERS,
    MAMBA_CACHE_MODES,
    REQUEST_PARAMS,
    SCRIPTED_PATTERNS,
    TIERS,
    EngineSettings,
    RequestSpec,
    Scenario,
    ScenarioDef,
    freeze_params,
    sampling_value,
)

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
                   json.loads(value) if name == "structured_outputs" else
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


# ---- validation: every field of a file, before any work ------------------------------------------------
# One rule per key (type, range, whether required); a field added to EngineSettings or RequestSpec needs its
# row here (tests/conformance/test_scenario_files.py holds the tables to the dataclasses).


@dataclass(frozen=True)
class Rule:
    """What one key of a scenario file may hold. ``kind``: "int", "bool", "str", "choice", "ids" (token ids
    of the file's vocabulary), "prompt" (ids, or text), "list", "dict"."""

    kind: str
    required: bool = False
    minimum: int | None = None  # "int": the least value
    nullable: bool = False  # null is allowed (and means the default)
    choices: tuple = ()  # "choice"
    nonempty: bool = False  # "str", "list", "prompt": not empty


SETTINGS_RULES: dict[str, Rule] = {
    "num_speculative_tokens": Rule("int", minimum=0),
    "drafter": Rule("choice", choices=DRAFTERS),
    "pattern": Rule("choice", choices=SCRIPTED_PATTERNS),
    "prompt_lookup_min": Rule("int", minimum=1, nullable=True),
    "prompt_lookup_max": Rule("int", minimum=1, nullable=True),
    "draft_model": Rule("str", nullable=True, nonempty=True),
    "max_num_seqs": Rule("int", minimum=1),
    "max_num_batched_tokens": Rule("int", minimum=1),
    "block_size": Rule("int", minimum=1),
    "num_kv_blocks": Rule("int", minimum=1, nullable=True),
    "max_model_len": Rule("int", minimum=1, nullable=True),
    "enable_prefix_caching": Rule("bool"),
    "mamba_cache_mode": Rule("choice", choices=MAMBA_CACHE_MODES, nullable=True),
}
REQUEST_RULES: dict[str, Rule] = {
    "request_id": Rule("str", required=True, nonempty=True),
    "prompt": Rule("prompt", required=True),
    "max_tokens": Rule("int", required=True, minimum=1),
    "arrival_step": Rule("int", minimum=0),
    "ignore_eos": Rule("bool"),
    "stop_token_ids": Rule("ids"),
    "abort_step": Rule("int", minimum=0, nullable=True),
    "extends": Rule("str", nullable=True, nonempty=True),
    "params": Rule("dict", nullable=True),  # SamplingParams fields in vLLM's names (``_params_problem``)
}
FILE_RULES: dict[str, Rule] = {
    "format": Rule("str", required=True),
    "id": Rule("str", required=True, nonempty=True),
    "description": Rule("str"),
    "settings": Rule("dict", required=True),
    "graph_mode": Rule("choice", choices=GRAPH_MODES, nullable=True),
    "vocab_size": Rule("int", required=True, minimum=1),
    "requests": Rule("list", required=True, nonempty=True),
    "triggers": Rule("list"),
    "origin": Rule("dict"),
}


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _problem(rule: Rule, v, vocab: int | None, extends: bool = False) -> str | None:
    """What is wrong with value ``v`` under ``rule`` ("must be ..."), or None."""
    if v is None:
        return None if rule.nullable else f"must not be null{_expect(rule)}"
    if rule.kind == "int":
        if not _int(v) or (rule.minimum is not None and v < rule.minimum):
            return f"must be an integer >= {rule.minimum}" + (" or null" if rule.nullable else "")
    elif rule.kind == "bool" and not isinstance(v, bool):
        return "must be true or false"
    elif rule.kind == "str" and (not isinstance(v, str) or (rule.nonempty and not v.strip())):
        return "must be a non-empty string" if rule.nonempty else "must be a string"
    elif rule.kind == "choice" and v not in rule.choices:
        return f"must be one of {', '.join(map(str, rule.choices))}" + (" or null" if rule.nullable else "")
    elif rule.kind == "dict" and not isinstance(v, dict):
        return "must be an object"
    elif rule.kind == "list" and (not isinstance(v, list) or (rule.nonempty and not v)):
        return "must be a non-empty list" if rule.nonempty else "must be a list"
    elif rule.kind == "ids" or (rule.kind == "prompt" and not isinstance(v, str)):
        return _ids_problem(v, vocab, empty_ok=rule.kind == "ids" or extends)
    elif rule.kind == "prompt" and not v.strip():
        return "must be a non-empty text or a non-empty list of token ids"
    return None


def _ids_problem(v, vocab: int | None, empty_ok: bool) -> str | None:
    what = f"token ids in [0, {vocab}) (the file's vocab_size)" if vocab else "token ids"
    if not isinstance(v, list) or not all(_int(t) for t in v):
        return f"must be a list of {what}"
    if not v and not empty_ok:
        return "must not be empty (a prompt needs at least one token)"
    bad = [t for t in v if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        return f"must hold {what}; {bad[0]} is outside"
    return None


def _params_problem(params, vocab: int | None, max_tokens: int) -> str | None:
    """What is wrong with a request's ``params`` object (a field ``SamplingParams`` does not take or refuses,
    an id outside the file's vocabulary), or None."""
    if not params:
        return None
    from refengine.config import ConfigError
    from refengine.sampling_params import SamplingParams

    unknown = [k for k in params if k not in REQUEST_PARAMS]
    if unknown:
        near = difflib.get_close_matches(str(unknown[0]), list(REQUEST_PARAMS), n=1)
        return f"unknown key {unknown[0]!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
    keys = list(params.get("logit_bias") or {}) if isinstance(params.get("logit_bias"), dict) else []
    ids = list(params.get("allowed_token_ids") or []) + [int(t) for t in keys if str(t).isdigit()]
    bad = [t for t in ids if not _int(t) or t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        return f"token id {bad[0]!r} is outside [0, {vocab}) (the file's vocab_size)"
    try:
        frozen = freeze_params(params)
        SamplingParams(max_tokens=max_tokens, **{k: sampling_value(k, v) for k, v in frozen})
    except (ConfigError, ValueError, TypeError) as e:
        return str(e)
    return None


def _expect(rule: Rule) -> str:
    return {"int": f" (an integer >= {rule.minimum})", "bool": " (true or false)", "str": " (a string)",
            "choice": f" (one of {', '.join(map(str, rule.choices))})"}.get(rule.kind, "")


def _check_keys(obj: dict, rules: dict[str, Rule], at: str) -> None:
    """Unknown keys (named, with the nearest known one) and missing required keys."""
    at = at[:-1] + ": " if at.endswith(".") else at
    for key in obj:
        if key not in rules:
            near = difflib.get_close_matches(str(key), list(rules), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f" (known: {', '.join(rules)})"
            raise ScenarioFileError(f"{at}unknown key {key!r}{hint}")
    for key, rule in rules.items():
        if rule.required and key not in obj:
            raise ScenarioFileError(f"{at}missing required key {key!r}")


def _check(obj: dict, rules: dict[str, Rule], at: str, vocab: int | None = None,
           extends: bool = False) -> None:
    _check_keys(obj, rules, at)
    for key, v in obj.items():
        problem = _problem(rules[key], v, vocab, extends)
        if problem:
            raise ScenarioFileError(f"{at}{key} {problem}, got {json.dumps(v)[:60]}")


def validate(d, where: str = "") -> None:
    """Refuse a file's contents naming the first key that is unknown, missing, of the wrong type or out of
    range (``ScenarioFileError``, one line): before any engine is built."""
    if not isinstance(d, dict):
        raise ScenarioFileError(f"{where}not a scenario file (a JSON {type(d).__name__}, expected an object "
                                f"with \"format\": {FORMAT!r})")
    if d.get("format") != FORMAT:
        raise ScenarioFileError(
            f"{where}not a scenario file (format {d.get('format')!r}, expected {FORMAT!r})"
        )
    _check(d, FILE_RULES, where)
    _check(d["settings"], SETTINGS_RULES, f"{where}settings.")
    vocab = d["vocab_size"]
    for i, r in enumerate(d["requests"]):
        at = f"{where}requests[{i}]" + (f" ({r.get('request_id')})" if isinstance(r, dict) and
                                        isinstance(r.get("request_id"), str) else "") + "."
        if not isinstance(r, dict):
            raise ScenarioFileError(f"{at[:-1]} must be an object, got {json.dumps(r)[:60]}")
        _check(r, REQUEST_RULES, at, vocab, extends=r.get("extends") is not None)
        problem = _params_problem(r.get("params"), vocab, r.get("max_tokens"))
        if problem:
            raise ScenarioFileError(f"{at}params: {problem}")
        if r.get("abort_step") is not None and r["abort_step"] < r.get("arrival_step", 0):
            raise ScenarioFileError(f"{at}abort_step {r['abort_step']} comes before its arrival_step "
                                    f"{r.get('arrival_step', 0)}")
    bad = [t for t in d.get("triggers") or [] if not isinstance(t, str) or not t]
    if bad:  # whether a name is a known trigger is the checks' to say (checks.triggers.unknown_trigger)
        raise ScenarioFileError(f"{where}triggers: a trigger is a non-empty name, got {json.dumps(bad[0])}")


def scenario_from_dict(
    d: dict, vocab_size: int | None = None, tier: str = "default", source: str = ""
) -> Scenario:
    """A Scenario from a file's contents (validated first: ``validate``); ``vocab_size``: the model's (ids
    modulo it when smaller)."""
    where = f"{source}: " if source else ""
    validate(d, where)
    try:
        settings = EngineSettings(**d["settings"])
    except (TypeError, ValueError) as e:  # combinations: lookup lengths without n-gram, a cache mode off
        raise ScenarioFileError(f"{where}settings: {e}") from None
    graph_mode = d.get("graph_mode")
    file_vocab = d["vocab_size"]
    remap = vocab_size is not None and vocab_size < file_vocab

    def ids(values) -> tuple[int, ...]:
        return tuple(t % vocab_size if remap else t for t in values)

    requests = []
    try:
        for r in d["requests"]:
            prompt = r["prompt"] if isinstance(r["prompt"], str) else ids(r["prompt"])
            requests.append(RequestSpec(r["request_id"], prompt, r["max_tokens"], r.get("arrival_step") or 0,
                                        True if r.get("ignore_eos") is None else r["ignore_eos"],
                                        ids(r.get("stop_token_ids") or ()), r.get("abort_step"),
                                        r.get("extends"),
                                        _params_from_json(r.get("params"), vocab_size if remap else None)))
    except ValueError as e:  # a request the workload cannot hold (a bad extends)
        raise ScenarioFileError(f"{where}{e}") from None
    ids_seen = [r.request_id for r in requests]
    if len(set(ids_seen)) != len(ids_seen):
        dup = next(i for i in ids_seen if ids_seen.count(i) > 1)
        raise ScenarioFileError(f"{where}duplicate request ids ({dup!r} twice)")
    description = d.get("description") or ""
    if remap:
        description += f" (token ids taken modulo {vocab_size}: drawn for a vocabulary of {file_vocab})"
    try:
        return Scenario(d["id"], description, tier, settings, tuple(requests), tuple(d.get("triggers") or ()),
                        graph_mode)
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
