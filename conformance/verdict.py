"""How a run judges the engine under test's tokens: ``exact`` or ``rescored`` (``--verdict``).

``exact`` (the default): the reference engine runs in the engine's dtype and every token, draft and logits
digest must be bitwise its own. Right for an engine that runs the reference's kernels (this project's).

``rescored``: the reference engine, in ``--reference-dtype`` (default: the run's dtype), scores the engine's
own output (``conformance.scoring``: one teacher-forced prefill per request). At every position the
engine's token must be the reference's pick or within the **tolerance** (nats below it) calibrated for the
(engine dtype, reference dtype) pair: a divergence within it is a *near-tie*, one beyond it *structural*,
and a structural one fails (the ``rescored`` check). The whole output is judged, not only up to its first
difference. The checks that compare the two engines bitwise then hold as they are where the engine is bitwise
the reference (``bitwise_comparable``). Where it is not, but declares ``bitwise`` (it runs the reference's
kernels: bitwise the reference engine in its own dtype on its own device) and is judged by a reference in
another dtype or on another device, the reference engine runs a second time, in the engine's dtype on its
device, and the bitwise checks (acceptance, drafts, logits digests, logprobs, seeded draws, ...) are held to
that run (``bitwise_in_own_dtype``), while its greedy tokens are judged by the rescoring: a corruption whose
only symptom is a draft, a digest, a logprob or a seeded draw cannot hide inside the tolerance. An engine
that does not declare ``bitwise`` (vLLM): each bitwise check says why it is n/a, or judges what still holds.

``auto``: ``exact`` when the adapter declares ``bitwise`` (it runs the reference's kernels: its tokens,
drafts and logits are bitwise the reference engine's in the same dtype) and the reference runs in the
engine's dtype on its device; else ``rescored``.

The tolerances are ``conformance/calibration.json`` (``conformance calibrate`` writes it): this project's own
engines in each dtype scored by the reference in another, over the corpus on every family; the tolerance of
a pair is its largest observed margin times the file's stated headroom. Torch-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

VERDICTS = ("exact", "rescored", "auto")
CALIBRATION_FILE = Path(__file__).with_name("calibration.json")
CALIBRATION_FORMAT = "conformance-calibration/1"
# What holding the bitwise checks to the reference in the engine's own dtype judges, in words.
BITWISE_HELD = ("acceptance, drafts, logits digests, logprobs and seeded draws bitwise, the engine declaring "
                "itself bitwise the reference in its own dtype; its greedy tokens judged by the rescoring")


class VerdictError(ValueError):
    """A verdict that cannot judge this run (one line: why, and what to change)."""


class CalibrationError(VerdictError):
    """No usable tolerance for a pair (one line: the pair and how to get one)."""


@dataclass(frozen=True)
class Verdict:
    """How one run judges the engine under test (``choose`` makes it)."""

    mode: str = "exact"  # "exact" | "rescored"
    dtype: str = "float32"  # the engine under test's
    reference_dtype: str = "float32"  # the reference's (the engine's own under "exact")
    tolerance: float = 0.0  # nats a token may lie below the reference's pick ("rescored")
    source: str = ""  # where the tolerance comes from, in words
    # The engine is bitwise the reference here (it declares "bitwise" and both run in one dtype on one
    # device): the bitwise checks hold under "rescored" too.
    bitwise_comparable: bool = True
    # Not bitwise_comparable, but the engine declares "bitwise" (bitwise the reference engine in its own dtype
    # on its own device): the bitwise checks are held to a second reference run in ``dtype`` on the engine's
    # device, the greedy tokens judged by the rescoring (``conformance.checks.rescored.judge``).
    bitwise_in_own_dtype: bool = False

    @property
    def rescored(self) -> bool:
        return self.mode == "rescored"

    def describe(self) -> str:
        """The verdict in one line, as the run's header and each report say it."""
        if not self.rescored:
            return (f"verdict exact: tokens, drafts and logits compared bitwise with the reference engine in "
                    f"{self.dtype}")
        if self.bitwise_comparable:
            kept = "the bitwise checks still apply (the engine is bitwise the reference here)"
        elif self.bitwise_in_own_dtype:
            kept = f"the bitwise checks are held to {self.bitwise_reference} ({BITWISE_HELD})"
        else:
            kept = "the bitwise checks are n/a, each saying why"
        return (f"verdict rescored: the reference engine in {self.reference_dtype} scores the engine's own "
                f"{self.dtype} output; a token more than {self.tolerance:.4g} nats below the reference's "
                f"pick is structural and fails, one within it a near-tie ({self.source}); {kept}")

    @property
    def bitwise_reference(self) -> str:
        """The reference the bitwise checks are held to, in words."""
        if self.bitwise_in_own_dtype:
            return f"the reference engine in the engine's own dtype, {self.dtype}"
        return f"the reference engine in {self.reference_dtype}"

    def own_dtype(self) -> Verdict:
        """The verdict the bitwise checks are judged under where ``bitwise_in_own_dtype``: rescored, the
        engine bitwise the reference (the one in its own dtype)."""
        return replace(self, reference_dtype=self.dtype, bitwise_comparable=True, bitwise_in_own_dtype=False)

    def classify(self, margin: float) -> str:
        """"match" (the reference's pick), "near-tie" (within the tolerance) or "structural"."""
        if margin <= 0.0:
            return "match"
        return "near-tie" if margin <= self.tolerance else "structural"


def choose(requested: str, *, bitwise: bool, dtype: str, reference_dtype: str | None = None,
           device: str = "cpu", reference_device: str | None = None, tolerance: float | None = None,
           table: dict | None = None) -> Verdict:
    """The verdict of a run: ``requested`` ("exact" | "rescored" | "auto"), for an adapter that declares
    ``bitwise`` or not, the engine's ``dtype`` and ``device`` and the reference's (None: the engine's).
    ``tolerance``: nats, instead of the calibrated one. Under rescored, a ``bitwise`` engine judged by a
    reference in another dtype or on another device has its bitwise checks held to the reference engine in
    its own dtype on its device (``Verdict.bitwise_in_own_dtype``). ValueError (one line) for a combination
    that cannot be judged."""
    if requested not in VERDICTS:
        raise VerdictError(f"verdict must be one of {', '.join(VERDICTS)}, got {requested!r}")
    ref_dtype = reference_dtype or dtype
    ref_device = reference_device or device
    comparable = bitwise and ref_dtype == dtype and ref_device == device
    held = bitwise and not comparable  # bitwise in its own dtype: held to the reference there (rescored)
    mode = requested if requested != "auto" else ("exact" if comparable else "rescored")
    if mode == "exact":
        if ref_dtype != dtype or ref_device != device:
            raise VerdictError(f"verdict exact compares bitwise with the reference in the engine's dtype on "
                               f"its device (got reference {ref_dtype} on {ref_device}, engine {dtype} on "
                               f"{device}): use --verdict rescored, or drop --reference-dtype / "
                               "--reference-device")
        if tolerance is not None:
            raise VerdictError("--tolerance applies to --verdict rescored only")
        return Verdict("exact", dtype, dtype, 0.0, "", True)
    if tolerance is not None:
        if not (math.isfinite(tolerance) and tolerance >= 0):
            raise VerdictError(f"tolerance must be a finite number of nats >= 0, got {tolerance}")
        return Verdict("rescored", dtype, ref_dtype, float(tolerance), "given by --tolerance", comparable,
                       held)
    tol, source = calibrated_tolerance(dtype, ref_dtype, table)
    return Verdict("rescored", dtype, ref_dtype, tol, source, comparable, held)


def pair_key(dtype: str, reference_dtype: str) -> str:
    """How the calibration table names a pair: ``"<engine dtype>/<reference dtype>"``."""
    return f"{dtype}/{reference_dtype}"


def load_table(path: str | Path | None = None) -> dict:
    """The calibration table (the packaged one unless ``path`` names another); CalibrationError when it
    is missing or not one."""
    path = Path(path) if path is not None else CALIBRATION_FILE
    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        raise CalibrationError(f"no calibration table at {path}: `conformance calibrate` writes it") from None
    except (OSError, ValueError) as e:
        raise CalibrationError(f"calibration table {path} cannot be read: {e}") from None
    if not isinstance(table, dict) or table.get("format") != CALIBRATION_FORMAT:
        raise CalibrationError(f"{path} is not a calibration table (format {CALIBRATION_FORMAT!r})")
    return table


def calibrated_tolerance(dtype: str, reference_dtype: str, table: dict | None = None) -> tuple[float, str]:
    """(tolerance in nats, where it comes from in words) of a pair, from the calibration table."""
    table = table if table is not None else load_table()
    pairs = table.get("pairs", {})
    entry = pairs.get(pair_key(dtype, reference_dtype))
    if entry is None:
        known = ", ".join(sorted(pairs)) or "none"
        how = (f"`conformance calibrate --dtypes {dtype}` measures it, or pass --tolerance NATS"
               if reference_dtype in ("float32", dtype) else "pass --tolerance NATS")
        raise CalibrationError(f"no calibrated tolerance for an engine in {dtype} against the reference in "
                               f"{reference_dtype} (calibrated pairs: {known}): {how}")
    head = table.get("headroom")
    source = (f"calibrated: max margin {entry['max_margin']:.4g} nats of this project's own engines over "
              f"{entry['positions']} positions x headroom {head}")
    return float(entry["tolerance"]), source
