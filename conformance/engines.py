"""The engine boundary under its older module name: ``conformance.api`` (the protocol),
``conformance.adapters`` (loading by name) and ``conformance.adapters.refengine`` (this project's engines).
Adapters written against ``conformance.engines`` keep working; new code imports from those modules."""

from conformance.adapters import BUILTIN_ENGINES, describe_engine, load_engine  # noqa: F401
from conformance.adapters.refengine import (  # noqa: F401
    CACHING_ENGINES,
    LLMInstance,
    RefEngineAdapter,
    cached_reference_adapter,
    draft_model_path,
    reference_adapter,
)
from conformance.api import (  # noqa: F401
    DRAFTER_FEATURES,
    FEATURES,
    REQUIRABLE_FEATURES,
    SCENARIO_FEATURES,
    EngineAdapter,
    EngineInstance,
    EngineRefused,
    RequestParams,
    RunSpec,
    UnknownEngine,
    missing_features,
)
