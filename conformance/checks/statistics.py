"""The statistical checks of sampled output (nightly): what no exact check can see, a bug both engines share.

Both read groups of requests that differ in their seed only (one prompt, one set of sampling
parameters, many seeds: ``sampling_groups``), and judge each group with a chi-square test at a stated
false-alarm rate. The seeds are a fixed set, so each run gives the same verdict; the rate is the chance
that a correct sampler fails on a seed set drawn at random, per group (``ALPHA``, Bonferroni-split over
the group's tests).

``sampler-frequencies``: the first tokens of a group against the distribution the sampling parameters
define, computed here, independently of ``refengine.sampling``, from the reference's raw logprobs of the
first position (the top 20: groups need ``logprobs=20`` and a ``top_k`` of at most 20, so the kept ids are
among them): softmax(logprobs / T) after min-p, top-k and top-p, in vLLM's order.

``spec-distribution``: the tokens of a speculative run (the engine under test, K drafts verified by
rejection sampling) against those of the plain run (reference engine, K=0: sampled one at a time), output
position by position past the first (the first is drawn the same way in both): a two-sample
chi-square test of homogeneity per position.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import torch

from conformance.checks.registry import CheckInputs, check
from conformance.results import CheckResult, failed, not_applicable, passed

ALPHA = 1e-3  # false-alarm rate per group (a correct sampler fails a random seed set this often)
MIN_SAMPLES = 500  # requests a group needs to be judged
MIN_EXPECTED = 5.0  # cells expecting fewer are merged into one
SPEC_POSITIONS = 3  # output positions past the first that spec-distribution compares


def sampling_groups(scenario) -> dict[tuple, list[str]]:
    """Request ids of sampled requests, grouped by (prompt, max_tokens, parameters but the seed); only
    groups of at least MIN_SAMPLES requests with distinct seeds."""
    groups: dict[tuple, list] = defaultdict(list)
    for r in scenario.requests:
        if r.samples and isinstance(r.prompt, tuple):
            key = (r.prompt, r.max_tokens, tuple(p for p in r.params if p[0] != "seed"))
            groups[key].append(r)
    return {k: [r.request_id for r in v] for k, v in groups.items()
            if len(v) >= MIN_SAMPLES and len({r.sampling.get("seed") for r in v}) == len(v)}


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for a chi-square X with ``dof`` degrees of freedom."""
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def expected_first_token(logprobs: list[list], temperature: float, top_k: int, top_p: float,
                         min_p: float) -> dict[int, float]:
    """{id: probability} of the first token: the top logprobs ([[id, logprob], ...]) tempered, then
    min-p, top-k (<= their count) and top-p, renormalised over what is kept."""
    z = sorted(((lp / temperature, t) for t, lp in logprobs), reverse=True)
    top = z[0][0]
    if min_p > 0:
        z = [(v, t) for v, t in z if v - top >= math.log(min_p)]
    if top_k > 0:
        kth = z[min(top_k, len(z)) - 1][0]
        z = [(v, t) for v, t in z if v >= kth]
    mass = sum(math.exp(v - top) for v, _ in z)
    kept, before = [], 0.0
    for v, t in z:
        if before < top_p:
            kept.append((v, t))
        before += math.exp(v - top) / mass
    total = sum(math.exp(v - top) for v, _ in kept)
    return {t: math.exp(v - top) / total for v, t in kept}


def goodness_of_fit(counts: Counter, expected: dict[int, float]) -> tuple[float, int, float]:
    """(chi-square, degrees of freedom, p-value) of ``counts`` against ``expected`` probabilities; cells
    expecting fewer than MIN_EXPECTED are pooled."""
    n = sum(counts.values())
    cells, rest_obs, rest_exp = [], 0, 0.0
    for t, p in expected.items():
        if n * p >= MIN_EXPECTED:
            cells.append((counts.get(t, 0), n * p))
        else:
            rest_obs, rest_exp = rest_obs + counts.get(t, 0), rest_exp + n * p
    if rest_exp > 0:
        cells.append((rest_obs, rest_exp))
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    return chi2, len(cells) - 1, chi2_sf(chi2, len(cells) - 1)


def homogeneity(a: Counter, b: Counter) -> tuple[float, int, float]:
    """(chi-square, degrees of freedom, p-value) of the two samples ``a`` and ``b`` coming from one
    distribution; categories expecting fewer than MIN_EXPECTED in either sample are pooled."""
    na, nb = sum(a.values()), sum(b.values())
    cells, pooled = [], [0, 0]
    for c in sorted(set(a) | set(b)):
        both = a.get(c, 0) + b.get(c, 0)
        if both * min(na, nb) / (na + nb) >= MIN_EXPECTED:
            cells.append((a.get(c, 0), b.get(c, 0)))
        else:
            pooled[0] += a.get(c, 0)
            pooled[1] += b.get(c, 0)
    if sum(pooled):
        cells.append(tuple(pooled))
    chi2 = 0.0
    for x, y in cells:
        both = x + y
        for obs, n in ((x, na), (y, nb)):
            e = both * n / (na + nb)
            chi2 += (obs - e) ** 2 / e
    return chi2, len(cells) - 1, chi2_sf(chi2, len(cells) - 1)


def _params(scenario, rid: str) -> dict:
    return next(r.sampling for r in scenario.requests if r.request_id == rid)


def check_sampler_frequencies(scenario, reference, test) -> CheckResult:
    name = "sampler-frequencies"
    groups = {k: ids for k, ids in sampling_groups(scenario).items()
              if 1 <= _params(scenario, ids[0]).get("top_k", 0) <= 20
              and _params(scenario, ids[0]).get("logprobs") == 20}
    if not groups:
        return not_applicable(name, f"no group of {MIN_SAMPLES}+ sampled requests differing only in their "
                              "seed, with logprobs=20 and top_k in 1..20")
    lines = []
    for ids in groups.values():
        p = _params(scenario, ids[0])
        ref = reference.requests[ids[0]]
        if not ref.logprobs:
            return failed(name, f"request {ids[0]}: the reference reported no logprobs", request_id=ids[0])
        expected = expected_first_token(ref.logprobs[0], p["temperature"], p.get("top_k", 0),
                                        p.get("top_p", 1.0), p.get("min_p", 0.0))
        counts = Counter(test.requests[r].token_ids[0] for r in ids if test.requests.get(r)
                         and test.requests[r].token_ids)
        outside = sorted(set(counts) - set(expected))
        label = ", ".join(f"{k}={v}" for k, v in sorted(p.items()) if k not in ("seed", "logprobs"))
        if outside:
            return failed(name, f"{label}: first tokens {outside[:5]} lie outside the ids the filters keep",
                          f"group {label} ({len(ids)} requests): tokens the parameters exclude were sampled "
                          f"({ {t: counts[t] for t in outside[:5]} }); kept ids: {sorted(expected)}",
                          request_id=ids[0])
        chi2, dof, pv = goodness_of_fit(counts, expected)
        lines.append(f"{label}: n={sum(counts.values())}, chi2={chi2:.1f}, dof={dof}, p={pv:.3g}")
        if pv < ALPHA:
            n = sum(counts.values())
            worst = sorted(expected, key=lambda t: -abs(counts.get(t, 0) - expected[t] * n))
            rows = "\n".join(f"    id {t}: observed {counts.get(t, 0)}, expected {expected[t] * n:.1f}"
                             for t in worst[:6])
            return failed(name, f"{label}: first-token frequencies differ from softmax(logits / T) after the "
                          f"filters (p={pv:.3g} < {ALPHA})",
                          f"group {label}, {n} seeds: chi-square {chi2:.1f} on {dof} degrees of freedom, "
                          f"p={pv:.3g} (false-alarm rate {ALPHA})\n{rows}", request_id=ids[0])
    return passed(name, "; ".join(lines))


@check(
    "sampler-frequencies",
    reads=("ref", "test"),
    passes_when=(
        "in each group of 500+ sampled requests that differ only in their seed (logprobs=20, top_k <= 20), "
        "the first tokens fit softmax(logprobs / T) after min-p, top-k and top-p, computed from the "
        "reference's raw logprobs (chi-square, false-alarm rate 1e-3 per group), and none lies outside "
        "the ids the filters keep"
    ),
    replay=False,
)
def _sampler_frequencies(c: CheckInputs) -> CheckResult:
    return check_sampler_frequencies(c.scenario, c.ref, c.test)


def _tokens_at(trace, ids: list[str], j: int) -> Counter:
    """The tokens at output position ``j`` of requests ``ids`` (-1 for one that ended before it)."""
    return Counter(trace.requests[r].token_ids[j] if len(trace.requests[r].token_ids) > j else -1
                   for r in ids if trace.requests.get(r) is not None)


def check_spec_distribution(scenario, plain, test) -> CheckResult:
    name = "spec-distribution"
    groups = sampling_groups(scenario)
    if plain is None or not groups:
        return not_applicable(name, f"no speculative group of {MIN_SAMPLES}+ sampled requests differing only "
                              "in their seed")
    lines = []
    for (_, max_tokens, _), ids in groups.items():
        p = _params(scenario, ids[0])
        label = ", ".join(f"{k}={v}" for k, v in sorted(p.items()) if k != "seed")
        width = min(SPEC_POSITIONS, max_tokens - 1)
        for j in range(1, 1 + width):
            spec, alone = _tokens_at(test, ids, j), _tokens_at(plain, ids, j)
            chi2, dof, pv = homogeneity(spec, alone)
            lines.append(f"{label} position {j}: n={len(ids)}, chi2={chi2:.1f}, dof={dof}, p={pv:.3g}")
            if pv < ALPHA / width:
                return failed(name, f"{label}: speculative tokens at output position {j} are not distributed "
                              f"as plain sampling's (p={pv:.3g} < {ALPHA / width:.2g})",
                              f"group {label}, {len(ids)} seeds, output position {j}: chi-square {chi2:.1f} "
                              f"on {dof} degrees of freedom, p={pv:.3g} (false-alarm rate {ALPHA} per group, "
                              f"split over {width} positions)\n  speculative: {spec.most_common(6)}\n"
                              f"  plain      : {alone.most_common(6)}", request_id=ids[0])
    return passed(name, "; ".join(lines))


@check(
    "spec-distribution",
    reads=("plain", "test"),
    passes_when=(
        "in each group of 500+ sampled requests that differ only in their seed, the speculative run's tokens "
        "at output positions 1..3 are distributed as the plain (K=0) reference run's (chi-square test of "
        "homogeneity per position, false-alarm rate 1e-3 per group)"
    ),
    replay=False,
)
def _spec_distribution(c: CheckInputs) -> CheckResult:
    return check_spec_distribution(c.scenario, c.plain if c.scenario.k else None, c.test)
