"""Expected-failure files: honoured when the check fails, reported as stale when it passes."""

from __future__ import annotations

import pytest

from conformance.checks import CHECK_NAMES
from conformance.expectations import (
    ExpectationError,
    Expectations,
    expectations_file_for,
    judge,
    load_expectations,
    unknown_entries,
)
from conformance.results import CheckResult, ScenarioResult
from conformance.workloads import scenario_ids


def _result(*failing: str, sid: str = "chunk-tails-k3") -> ScenarioResult:
    checks = [CheckResult(name, "fail" if name in failing else "pass", "...") for name in CHECK_NAMES]
    return ScenarioResult(sid, "d", "default", "async", "m", "K=3", checks)


def test_expected_failure_is_honoured():
    exp = Expectations("f.toml", {"chunk-tails-k3/tokens": "issue 12"})
    v = judge(_result("tokens"), exp)
    assert v.outcome == "xfail" and v.expected == {"tokens": "issue 12"} and not v.stale


def test_unlisted_failure_still_fails():
    exp = Expectations("f.toml", {"chunk-tails-k3/tokens": "issue 12"})
    v = judge(_result("tokens", "acceptance"), exp)
    assert v.outcome == "fail" and v.unexpected == ["acceptance"]


def test_entry_that_passes_is_stale():
    exp = Expectations("f.toml", {"chunk-tails-k3/tokens": "issue 12", "chunk-tails-k3/acceptance": "x"})
    v = judge(_result("tokens"), exp)
    assert v.outcome == "xfail" and v.stale == ["chunk-tails-k3/acceptance"]
    assert "chunk-tails-k3/acceptance" in v.stale_message("f.toml")
    assert judge(_result(), exp).outcome == "pass"
    assert len(judge(_result(), exp).stale) == 2


def test_any_check_wildcard():
    exp = Expectations("f.toml", {"chunk-tails-k3/*": "flaky kernel"})
    assert judge(_result("tokens", "acceptance"), exp).outcome == "xfail"
    assert judge(_result(), exp).stale == ["chunk-tails-k3/*"]


def test_files_load_and_typos_are_found(tmp_path):
    f = tmp_path / "e.toml"
    f.write_text(
        '[expected-failures]\n"chunk-tails-k3/tokens" = "issue 1"\n"chunk-tails-k9/tokens" = "typo"\n'
        '"mtp-k3/tokenz" = "typo"\n'
    )
    exp = load_expectations(f)
    assert exp.for_scenario("chunk-tails-k3") == {"tokens": "issue 1"}
    assert unknown_entries(exp, scenario_ids("nightly"), CHECK_NAMES) == [
        "chunk-tails-k9/tokens",
        "mtp-k3/tokenz",
    ]
    f.write_text('[expected-failures]\n"no-slash" = "x"\n')
    with pytest.raises(ExpectationError):
        load_expectations(f)
    f.write_text("not toml [")
    with pytest.raises(ExpectationError):
        load_expectations(f)


def test_packaged_files():
    for engine in ("reference", "async", "async:full", "async:none"):
        path = expectations_file_for(engine)
        assert path is not None and load_expectations(path).entries == {}
    assert expectations_file_for("async:full").name == "async.toml"
    assert expectations_file_for("somepkg.mod:factory") is None


def test_entries_scoped_to_a_model_or_family_hold_there_only(tmp_path):
    f = tmp_path / "e.toml"
    f.write_text(
        '[expected-failures]\n"chunk-tails-k3/acceptance" = "everywhere"\n'
        '[models."tiny:llama".expected-failures]\n"chunk-tails-k3/tokens" = "llama only"\n'
        '[families.nemotron_h.expected-failures]\n"chunk-tails-k3/drafts" = "Mamba2 hybrids"\n'
    )
    exp = load_expectations(f)
    assert exp.count() == 3
    on = {"llama": ("/tmp/resolved", "tiny:llama", "llama"), "qwen3": ("tiny:qwen3", "", "qwen3"),
          "nemotron": ("some/folder", "some/folder", "nemotron_h")}

    def verdict(where, *failing):
        r = _result(*failing)
        r.model, r.model_name, r.family = on[where]
        return judge(r, exp)

    assert verdict("llama", "tokens", "acceptance").outcome == "xfail"
    assert verdict("qwen3", "tokens", "acceptance").unexpected == ["tokens"]  # not excused on another model
    assert verdict("qwen3", "acceptance").stale == []  # nor reported stale there
    assert verdict("nemotron", "drafts", "acceptance").outcome == "xfail"
    assert verdict("llama", "drafts").unexpected == ["drafts"]
    assert sorted(verdict("llama").stale) == ["chunk-tails-k3/acceptance", "chunk-tails-k3/tokens"]
    assert unknown_entries(exp, scenario_ids("nightly"), CHECK_NAMES) == []
    f.write_text('[models."tiny:llama".expected-failures]\n"chunk-tails-k9/tokens" = "typo"\n')
    typo = load_expectations(f)
    assert unknown_entries(typo, scenario_ids("nightly"), CHECK_NAMES) == ["chunk-tails-k9/tokens"]
    for bad in ('[modles."tiny:llama".expected-failures]\n"chunk-tails-k3/tokens" = "x"\n',
                '[models."tiny:llama"]\n"chunk-tails-k3/tokens" = "x"\n',
                '[families.llama.expected-failures]\n"no-slash" = "x"\n'):
        f.write_text(bad)
        with pytest.raises(ExpectationError):
            load_expectations(f)
