"""The vLLM tier: the corpus through the installed vLLM (``--engine vllm``) on every family it loads, at
K=0, with every drafter it supports, with prefix caching and at TP=2, judged as any engine is judged.

``pytest -m vllm tests/vllm`` in an environment holding vLLM (``python ci/install_vllm.py``; `.ci/run`
makes one); skipped where vLLM is absent, and outside the default tier (``-m 'not vllm'`` in addopts).
Each case is one ``conformance run`` process (vLLM loads once per process), lean by default; the nightly
tier (``-m "vllm and nightly"``) runs every scenario of the default corpus on every family. Known vLLM
divergences are expected failures in conformance/expectations/vllm.toml, each with its replay in
conformance/findings/vllm/: the run is green only when nothing else fails, and an expected failure that
stops failing is reported stale (``--strict-expectations`` makes that fail).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.findings import finding_files

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here"),
]

# (case id, model, scenarios, extra flags): the lean tier, a handful of scenarios per family and feature.
LEAN = [
    ("llama-k0", "tiny:llama", ["short-prompts-k0", "preemption-k0", "chunk-tails-k0"], []),
    ("llama-drafters", "tiny:llama", ["ngram-k3", "draft-model-k3", "eagle3-k3"], []),
    ("llama-prefix-caching", "tiny:llama", ["prefix-system-prompt-k0", "pc-shared-prompt-k0-align"],
     ["--enable-prefix-caching"]),
    ("llama-tp2", "tiny:llama", ["short-prompts-k0"], ["--tensor-parallel-size", "2"]),
    ("qwen3-k0-ngram", "tiny:qwen3", ["short-prompts-k0", "ngram-k3"], []),
    ("nemotron_h-k0-mtp", "tiny:nemotron_h", ["short-prompts-k0", "mtp-k3", "ngram-k1"], []),
    ("nemotron_h-prefix-caching", "tiny:nemotron_h", ["pc-shared-prompt-k0-align"],
     ["--enable-prefix-caching"]),
]
FAMILIES = ["tiny:llama", "tiny:qwen3", "tiny:nemotron_h"]


def _run(tmp_path: Path, model: str, args: list[str]) -> tuple[int, dict, str]:
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "conformance", "run", "--engine", "vllm", "--model", model,
           "--report-json", str(report), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3000, check=False)
    out = proc.stdout + proc.stderr
    data = json.loads(report.read_text()) if report.is_file() else {}
    return proc.returncode, data, out


@pytest.mark.parametrize("case_id,model,scenarios,flags", LEAN, ids=[c[0] for c in LEAN])
def test_lean_tier(tmp_path, case_id, model, scenarios, flags):
    args = [a for s in scenarios for a in ("--scenario", s)]
    rc, data, out = _run(tmp_path, model, [*args, *flags, "--min-scenarios", "1"])
    tail = "\n".join(line for line in out.splitlines() if " INFO " not in line)[-6000:]
    assert rc == 0, f"conformance run through vLLM failed ({case_id}):\n{tail}"
    ran = data.get("summary", {}).get("scenarios", 0) - data.get("summary", {}).get("skipped", 0)
    assert ran >= 1, f"no scenario ran ({case_id}):\n{tail}"


def test_qwen3_next_in_bfloat16_under_the_rescored_verdict(tmp_path):
    """vLLM's CPU GDN kernel runs in bfloat16 only, where bitwise tokens are the wrong oracle: the reference
    in float32 re-scores vLLM's own output (--verdict rescored, calibrated tolerance), and the run is gated
    on that verdict. (No MTP scenario: vLLM's Qwen3-Next MTP model wants an MoE MTP layer, which the tiny
    head has not.)"""
    rc, data, out = _run(tmp_path, "tiny:qwen3_next", [
        "--dtype", "bfloat16", "--verdict", "rescored", "--reference-dtype", "float32",
        "--scenario", "short-prompts-k0", "--scenario", "ngram-k3"])
    tail = "\n".join(line for line in out.splitlines() if " INFO " not in line)[-6000:]
    assert rc == 0, f"Qwen3-Next through vLLM in bfloat16, rescored:\n{tail}"
    assert {sc.get("verdict") for sc in data.get("scenarios", [])} == {"rescored"}, tail


@pytest.mark.parametrize("finding", finding_files("vllm"), ids=lambda p: p.stem)
def test_findings_replay(tmp_path, finding):
    """Each committed finding still replays as the expected failure its expectations entry names (a finding
    vLLM fixed shows up here as stale, with the run's output)."""
    origin = json.loads(finding.read_text()).get("origin", {})
    extra = [] if origin.get("dtype", "float32") == "float32" else [
        "--dtype", origin["dtype"], "--verdict", "rescored", "--reference-dtype", "float32"]
    rc, _data, out = _run(tmp_path, origin.get("model", "tiny:llama"),
                          ["--scenario-file", str(finding), "--strict-expectations", *extra])
    tail = "\n".join(line for line in out.splitlines() if " INFO " not in line)[-6000:]
    assert rc == 0, f"finding {finding.stem} no longer replays as listed:\n{tail}"


@pytest.mark.nightly
@pytest.mark.parametrize("model", FAMILIES)
def test_whole_corpus(tmp_path, model):
    rc, _data, out = _run(tmp_path, model, ["--min-scenarios", "1"])
    assert rc == 0, "\n".join(line for line in out.splitlines() if " INFO " not in line)[-8000:]
