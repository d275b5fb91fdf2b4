"""A per-process cache of the reference engine's traces, for this repository's own test session.

The repository's tests run the same reference workloads many times (each mutant, each CLI test and
each scenario test runs the oracle, the plain run, the cached run and the bare run of its scenarios).
The reference engine is deterministic, so within one process a run is a function of what ``key``
names: the checkpoint's bytes, the whole scenario (not only its id: scenario files and generated
workloads exist), the settings, the run's label, dtype, the torch thread count and the kernel-backend
environment. Only CPU runs are stored. A hit returns a deep copy of the stored trace and leaves
torch's global random state as the run left it.

It is off unless ``enable()`` is called or ``CONFORMANCE_REFERENCE_CACHE_DIR`` names a folder
(tests/conftest.py does both, for the test session only: its xdist workers and the interpreters its
tests start then share the runs through that folder, one pickle per key, written atomically); the
``conformance`` commands never turn it on. It applies only to the stock reference engine: an adapter
of another type, a patched ``RefEngineAdapter.build``/``start`` or a patched ``refengine.LLM`` runs
as usual, so a test that swaps the reference side needs to do nothing. Runs that end in an error are
never stored.

The scripted drafter's truth (``refengine.llm.GreedyTruth``: a request's plain greedy output, a private
reference engine's run) is shared the same way (``share_truth``): the reference run of a scripted
scenario, the async engine's run of it and each mutant's run all ask for the same requests' truth. It
is served to the stock adapter only, and to a mutant that patches the async engine's own objects (one
that patches the model's mixers, which the truth engine shares, computes its own).
"""

from __future__ import annotations

import copy
import hashlib
import os
import pickle
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

_MAX_ENTRIES = 512
_ADAPTERS = "conformance.adapters.refengine"
_ENV = ("KERNELS_BACKEND", "TRITON_INTERPRET")
DIR_ENV = "CONFORMANCE_REFERENCE_CACHE_DIR"

_enabled = False
_entries: OrderedDict[tuple, tuple] = OrderedDict()
_digests: dict[tuple, str] = {}  # (folder, its files' names, sizes and mtimes) -> checkpoint digest
stats = {"hits": 0, "misses": 0}  # stored runs handed back, and runs made under the cache


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on
    if not on:
        _entries.clear()


def enabled() -> bool:
    return _enabled or bool(os.environ.get(DIR_ENV))


def _file(k: tuple) -> Path | None:
    folder = os.environ.get(DIR_ENV)
    if not folder or not Path(folder).is_dir():
        return None
    return Path(folder) / (hashlib.sha256(repr(k).encode()).hexdigest() + ".pickle")


def _stock_reference(adapter) -> bool:
    import refengine
    import refengine.llm
    from conformance.adapters.refengine import LLMInstance, RefEngineAdapter

    if type(adapter) is not RefEngineAdapter or adapter.engine != "reference" or adapter.graph_mode != "none":
        return False
    stock = (
        (RefEngineAdapter.build, _ADAPTERS, "RefEngineAdapter.build"),
        (RefEngineAdapter.start, _ADAPTERS, "RefEngineAdapter.start"),
        (LLMInstance, _ADAPTERS, "LLMInstance"),
        (refengine.LLM, "refengine.llm", "LLM"),
        (refengine.llm.LLM, "refengine.llm", "LLM"),
    )
    return all(getattr(obj, "__module__", None) == module and getattr(obj, "__qualname__", None) == name
               for obj, module, name in stock) and refengine.LLM is refengine.llm.LLM


def _checkpoint_digest(path: str | None) -> str | None:
    """The sha256 of every file under the checkpoint folder (names and bytes); None: not a folder.

    Every run asks for it: a folder whose files were last written over a second ago is read once, then
    known by its files' names, sizes and modification times (a later write moves a time past the one
    known; within the clock's tick of a write it might not, so a recent folder is read every time)."""
    if path is None or not Path(path).is_dir():
        return None
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    stats = [f.stat() for f in files]
    stamp = (str(root.resolve()), tuple((str(f.relative_to(root)), st.st_size, st.st_mtime_ns)
                                        for f, st in zip(files, stats)))
    if stamp in _digests:
        return _digests[stamp]
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")
    if all(st.st_mtime_ns < time.time_ns() - 1_000_000_000 for st in stats):
        _digests[stamp] = h.hexdigest()
    return h.hexdigest()


def key(adapter, scenario, facts, label: str, settings, device: str, dtype: str) -> tuple | None:
    """What the run depends on, or None when the cache does not apply (off, or not the stock reference)."""
    if not enabled() or device != "cpu" or not _stock_reference(adapter):
        return None
    digest = _checkpoint_digest(facts.path)
    if digest is None:
        return None
    import torch

    return (
        digest, repr(facts), repr(scenario), repr(settings), label, device, dtype, adapter.uncached,
        torch.get_num_threads(), str(torch.get_default_dtype()),
        tuple(os.environ.get(name) for name in _ENV),
    )


def get(k: tuple | None):
    """A copy of the stored trace for ``k`` (torch's random state set as that run left it), or None."""
    entry = _load(k)
    if entry is None:
        return None
    import torch

    trace, rng = entry
    torch.set_rng_state(rng)
    stats["hits"] += 1
    return copy.deepcopy(trace)


def put(k: tuple | None, trace) -> None:
    """Store a copy of ``trace`` (and torch's random state after the run) unless the run failed."""
    if k is None:
        return
    import torch

    stats["misses"] += 1
    if trace.error is not None:
        return
    _store(k, (copy.deepcopy(trace), torch.get_rng_state()))


def after_start(adapter, instance, spec) -> None:
    """Called by the harness once ``adapter.start(spec)`` gave ``instance``, before any request: a refengine
    instance (``LLMInstance``) then has its scripted drafter's truth served from the cache (``share_truth``).
    The adapters know nothing of this cache; it looks at what they built."""
    from conformance.adapters.refengine import LLMInstance

    if enabled() and isinstance(instance, LLMInstance):
        share_truth(adapter, instance.llm, spec)


def share_truth(adapter, llm, spec) -> None:
    """Serve ``llm``'s scripted drafter's truth from the cache, when it applies (see the module's doc): a
    request's truth is a function of the checkpoint's bytes, the truth engine's configuration, K, the
    request's prompt and parameters, the torch thread count and the kernel-backend environment."""
    drafter = llm.config.speculative.drafter
    truth = getattr(drafter, "truth", None)
    if not enabled() or spec.device != "cpu" or not _stock_truth(adapter, truth):
        return
    digest = _checkpoint_digest(llm.config.model)
    if digest is None:
        return
    import dataclasses

    import torch

    base = (
        "truth", digest, repr(dataclasses.replace(truth._config, model="")), truth._num_speculative_tokens,
        torch.get_num_threads(), str(torch.get_default_dtype()), tuple(os.environ.get(name) for name in _ENV),
    )

    def shared(req) -> list[int]:
        k = (*base, tuple(req.prompt_token_ids), repr(req.params))
        entry = _load(k)
        if entry is None:
            entry = (list(truth(req)),)
            _store(k, entry)
        return list(entry[0])

    def expect(req) -> None:  # the truth source runs together the expected requests the cache lacks
        if _load((*base, tuple(req.prompt_token_ids), repr(req.params))) is None:
            truth.expect(req)

    shared.expect = expect
    drafter.truth = shared


def _stock_truth(adapter, truth) -> bool:
    import refengine.llm
    from conformance.adapters.refengine import RefEngineAdapter

    if type(truth) is not refengine.llm.GreedyTruth or getattr(refengine.llm.ReferenceEngine, "__module__",
                                                                None) != "refengine.reference.engine":
        return False
    if type(adapter) is RefEngineAdapter:
        return True
    kind = type(adapter)
    mutant = getattr(adapter, "mutant", None)
    return ((kind.__module__, kind.__qualname__) == ("conformance.mutants", "MutantAdapter")
            and mutant is not None and getattr(mutant, "family", None) is None)


def _load(k: tuple | None):
    """The entry stored for ``k`` (in this process, else in the folder), or None."""
    if k is None:
        return None
    if k not in _entries:
        path = _file(k)
        if path is None or not path.is_file():
            return None
        _remember(k, pickle.loads(path.read_bytes()))
    _entries.move_to_end(k)
    return _entries[k]


def _store(k: tuple, entry: tuple) -> None:
    _remember(k, entry)
    path = _file(k)
    if path is not None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(entry, f)
        os.replace(tmp, path)


def _remember(k: tuple, entry: tuple) -> None:
    _entries[k] = entry
    while len(_entries) > _MAX_ENTRIES:
        _entries.popitem(last=False)
