"""One test per scenario of the selected tier: run it through the reference engine and the engine
under test, apply every check, and turn the result into pass / fail / xfail / skip.

The ``conformance_*`` fixtures and the scenario parametrisation come from the conformance pytest
plugin (conformance.plugin), which the package registers as a pytest11 entry point.
"""

from __future__ import annotations

from conformance.harness import run_scenario
from conformance.plugin import conclude


def test_scenario(conformance_scenario, conformance_case, conformance_expectations, request):
    result, _ = run_scenario(conformance_scenario, conformance_case)
    conclude(request, result, conformance_expectations)
