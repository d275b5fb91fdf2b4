"""This repository's own run of the shipped conformance suite (default tier).

Engine and model come from the ``conformance_default_*`` fixtures in conftest.py (the one place
to switch to the async engine and the embedded default model); ``--conformance-engine`` and
``CONFORMANCE_ENGINE`` still override them.
"""

from conformance.suite.test_conformance import test_scenario  # noqa: F401  (collected here)
