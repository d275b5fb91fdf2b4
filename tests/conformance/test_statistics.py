"""The statistical checks (conformance/checks/statistics.py): their arithmetic on the default tier, their
verdicts on the engines and on bugs both engines share nightly.

Nightly, each statistical scenario runs the async engine against the reference as the suite runs it,
then again with a bug patched into ``refengine.sampling`` itself, so both engines carry it and every exact
check still passes: only the statistical check can fail, and must.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from conformance import reference_cache
from conformance.checks.statistics import (
    ALPHA,
    chi2_sf,
    expected_first_token,
    goodness_of_fit,
    homogeneity,
)
from conformance.engines import RefEngineAdapter
from conformance.harness import Case, run_scenario
from conformance.model import describe_model
from refengine import sampling
from refengine.sampling import RowParams, filtered_logits


def test_chi2_tail_matches_known_values():
    assert math.isclose(chi2_sf(3.841, 1), 0.05, rel_tol=1e-3)
    assert math.isclose(chi2_sf(21.108, 3), 1e-4, rel_tol=1e-2)
    assert chi2_sf(0.0, 4) == 1.0


@pytest.mark.parametrize("t,top_k,top_p,min_p", [(1.0, 20, 1.0, 0.0), (0.7, 12, 0.8, 0.0),
                                                 (1.5, 20, 0.95, 0.05), (0.4, 5, 0.6, 0.3)])
def test_expected_distribution_is_the_samplers(t, top_k, top_p, min_p):
    """Written apart from ``refengine.sampling``: the same ids kept, the same probabilities."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, generator=g) * 2
    raw = torch.log_softmax(logits, -1)
    values, ids = torch.topk(raw, 20)
    want = expected_first_token([[int(i), float(v)] for i, v in zip(ids, values)], t, top_k, top_p, min_p)
    p = RowParams(torch.tensor([t]), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]),
                  torch.tensor([0]))
    probs = torch.softmax(filtered_logits(logits[None, None, :], p), -1)[0, 0]
    kept = {int(i) for i in torch.nonzero(probs).flatten()}
    assert kept == set(want)
    assert all(abs(want[i] - float(probs[i])) < 1e-5 for i in kept)


def test_goodness_of_fit_and_homogeneity_see_a_shift():
    p = {0: 0.5, 1: 0.3, 2: 0.2}
    exact = Counter({0: 1000, 1: 600, 2: 400})
    shifted = Counter({0: 900, 1: 600, 2: 500})
    assert goodness_of_fit(exact, p)[2] > 0.99
    assert goodness_of_fit(shifted, p)[2] < ALPHA
    assert homogeneity(exact, exact)[2] > 0.99
    assert homogeneity(exact, shifted)[2] < 0.01


# ---- nightly: the scenarios, on the engines and on shared bugs -------------------------------------------
def _run(scenario_id: str):
    adapter = RefEngineAdapter("async", "full_and_piecewise")
    case = Case("async", adapter, describe_model(None), None, "nightly", allow_unexercised=True)
    result, _ = run_scenario(scenario_id, case)
    assert result.error is None, result.error
    return {c.check: c for c in result.checks}


def _unnormalised(probs, drafts, u):
    residual = probs.to(torch.float64).scatter(-1, drafts[:, :, None], 0.0)
    picked = (torch.cumsum(residual, dim=-1) <= u[:, :, None]).sum(-1)
    last = probs.shape[-1] - 1 - (residual > 0).flip(-1).to(torch.int64).argmax(-1)
    return torch.minimum(picked, last)


def _shared(seed, position, salt, token=None, uniform=sampling.uniform):
    return uniform(seed, position, sampling.ACCEPT if salt == sampling.RECOVER else salt, token)


def _misordered(x, p, filtered=sampling.filtered_logits):
    kept = torch.isfinite(filtered(x, RowParams(torch.ones_like(p.temperature), p.top_k, p.top_p,
                                                p.min_p, p.seed)))
    y = filtered(x, RowParams(p.temperature, p.top_k, torch.ones_like(p.top_p), p.min_p, p.seed))
    return torch.where(kept, y, torch.full_like(y, float("-inf")))


SHARED_BUGS = {
    "unnormalised-residual": ("recover", _unnormalised),
    "shared-noise": ("uniform", _shared),
    "top-p-before-temperature": ("filtered_logits", _misordered),
}


@pytest.mark.nightly
@pytest.mark.parametrize("scenario_id,check,bug", [
    ("sampling-frequencies-k0", "sampler-frequencies", None),
    ("sampling-frequencies-k0", "sampler-frequencies", "top-p-before-temperature"),
    ("sampling-spec-distribution-k3", "spec-distribution", None),
    ("sampling-spec-distribution-k3", "spec-distribution", "unnormalised-residual"),
    ("sampling-spec-distribution-k3", "spec-distribution", "shared-noise"),
])
def test_statistical_check_passes_on_the_engines_and_fails_on_a_shared_bug(scenario_id, check, bug,
                                                                           monkeypatch, record_property):
    if bug is not None:  # in the module both engines call: no exact check can see it
        monkeypatch.setattr(sampling, *SHARED_BUGS[bug])
        monkeypatch.setattr(reference_cache, "enabled", lambda: False)  # the session's traces lack the bug
    checks = _run(scenario_id)
    record_property("summary", checks[check].summary)
    print(f"\n{scenario_id} {check} bug={bug}: {checks[check].status}: {checks[check].summary}")
    assert checks["tokens"].status == "pass"
    assert checks[check].status == ("pass" if bug is None else "fail"), checks[check].summary
