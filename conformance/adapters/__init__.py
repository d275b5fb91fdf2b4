"""Engines under test, by name: refengine's own (``reference``, ``async``, ``async:<graph mode>``), the
outside engines this package ships an adapter for (``vllm``: conformance/adapters/vllm.py, imported only
when named), or a user's adapter by import path (``pkg.module:factory``)."""

from __future__ import annotations

import importlib
import os
import sys

from conformance.api import EngineAdapter, UnknownEngine
from refengine.config import DEFAULT_ASYNC_GRAPH_MODE, GRAPH_MODES  # torch-free

# Outside engines with an adapter here: name -> "module:factory", imported only when asked for.
OUTSIDE_ENGINES = {"vllm": "conformance.adapters.vllm:VllmAdapter"}
BUILTIN_ENGINES = ("reference", "async", *(f"async:{m}" for m in GRAPH_MODES), *OUTSIDE_ENGINES)


def describe_engine(name: str) -> str:
    """An engine selection in words, with the graph mode plain ``async`` runs in (as every command says)."""
    if name == "async":
        return f"async (graph mode {DEFAULT_ASYNC_GRAPH_MODE}, unless a scenario names its own)"
    return name


def load_engine(name: str) -> EngineAdapter:
    """``reference``, ``async`` (graph mode DEFAULT_ASYNC_GRAPH_MODE), ``async:<graph mode>``, an outside
    engine's name (``vllm``, eager; ``vllm:<cudagraph mode>`` on CUDA), or ``pkg.module:attr``.

    (``mutant:<id>`` names are resolved one level up, by ``conformance.session``.)"""
    if name in ("reference", "async") or name.startswith("async:"):
        from conformance.adapters.refengine import RefEngineAdapter

        if name == "reference":
            return RefEngineAdapter("reference", "none")
        return RefEngineAdapter("async", name.partition(":")[2] or DEFAULT_ASYNC_GRAPH_MODE)
    if name in OUTSIDE_ENGINES:
        return _load(name, OUTSIDE_ENGINES[name])
    if name.startswith("vllm:"):  # vLLM with one of its cudagraph modes (CUDA; its CPU platform has none)
        from conformance.adapters.vllm import CUDAGRAPH_MODES, VllmAdapter

        mode = name.partition(":")[2]
        if mode.upper() not in CUDAGRAPH_MODES:
            raise UnknownEngine(f"unknown vLLM cudagraph mode {mode!r}: use one of "
                                f"{', '.join(m.lower() for m in CUDAGRAPH_MODES)}")
        return VllmAdapter(graph_mode=mode)
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise UnknownEngine(
            f"unknown engine {name!r}: use one of {', '.join(BUILTIN_ENGINES)} or an import path "
            "'package.module:factory'"
        )
    return _load(name, name)


def _load(name: str, path: str) -> EngineAdapter:
    module_name, _, attr = path.partition(":")
    try:
        obj = getattr(_import(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise UnknownEngine(f"cannot load engine {name!r}: {e}") from e
    except Exception as e:  # the user's module broke while importing: one line, not a traceback
        raise UnknownEngine(
            f"cannot load engine {name!r}: importing {module_name} raised {_one_line(e)}"
        ) from e
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "start")):
        try:
            obj = obj()
        except UnknownEngine:
            raise
        except Exception as e:  # the factory is the user's code: one line, not a traceback
            raise UnknownEngine(f"cannot load engine {name!r}: {attr}() raised {_one_line(e)}") from e
    if not isinstance(obj, EngineAdapter):
        raise UnknownEngine(f"engine {name!r} gave {type(obj).__name__}, which lacks name/supports()/start() "
                            "(see conformance.api.EngineAdapter)")
    return obj


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (a user's exception message may span several)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}".rstrip(": ")


def _import(module_name: str):
    """Import a module, also from the current directory (as ``python -m`` would) for local adapters."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if e.name != module_name.split(".")[0] or cwd in sys.path:
            raise
        sys.path.insert(0, cwd)
        return importlib.import_module(module_name)
