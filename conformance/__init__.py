"""Conformance suite: identical greedy workloads through the reference engine and an engine under
test, checked token for token, draft for draft, and against the engines' metadata contracts, on
Qwen3-Next / Qwen3.5 and Nemotron-H checkpoints (any family refengine loads).

Entry points: ``conformance`` (the CLI, conformance.cli), the pytest plugin (conformance.plugin,
with the suite in conformance.suite), and ``conformance.harness.run_scenario`` for scripts.
"""
