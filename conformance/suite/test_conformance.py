"""One test per scenario of the selected tier: run it through the reference engine and the engine
under test, apply every check, and turn the result into pass / fail / xfail / skip (an
infrastructure failure is a setup error of the test).

The ``conformance_*`` fixtures and the scenario parametrisation come from the conformance pytest
plugin (conformance.plugin), which the package registers as a pytest11 entry point.
"""

from __future__ import annotations

from conformance.plugin import conclude


def test_scenario(conformance_result, conformance_expectations, request):
    conclude(request, conformance_result, conformance_expectations)
