"""Tooling beside the engine: the ``refengine`` command line (generate, report, bench), the default
workload, and the training script and corpus of the embedded default model. Nothing in the engine
imports from here."""
