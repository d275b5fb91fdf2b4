"""The shipped conformance tests: ``pytest --pyargs conformance.suite --conformance-engine E``."""
