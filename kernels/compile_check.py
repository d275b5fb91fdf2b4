"""Compile every Triton kernel for NVIDIA targets at real model shapes, without a GPU.

    python -m kernels.compile_check --targets sm_80,sm_90 [--match TEXT] [--representative] [--record FILE]

Each op folder declares its cases in ``kernels/<op>/compile_cases.py``: a function
``compile_cases() -> list[CompileCase]``, discovered here by folder, so a new op registers its
kernels by adding that one module. Every case is compiled with Triton's own compiler for each
target (``triton.compile`` with a ``GPUTarget``; ptxas ships with Triton, no driver is needed), and
the report gives the shared memory the launch needs against the target's per-block opt-in limit,
the registers per thread and the spill (stack) bytes. The command exits 1 when a case cannot launch
on a target: shared memory over the limit, more registers than the SM has for the block, a compile
error, or (sm_90) a float32 ``wgmma`` operand staged in shared memory with a swizzle narrower than
128 bytes: a ``tl.dot`` reducing over fewer than 32 float32 elements, the compiled layout only the
chunk GDN kernels that hit an illegal memory access on an H100 had (kernels/gated_delta_rule/README.md).

With ``--record FILE`` a case whose compile is recorded in FILE under the same Triton cache key is
not compiled again: the key is the one Triton files its own cache under (the kernel's source and the
jit functions and globals it reads, the signature, constexprs and options, the target and its ptxas
version, Triton's own sources, the environment knobs that change code), so a recorded result is the
result the compile gives. Cases without a matching entry (a kernel or Triton changed) are compiled;
``--write-record`` stores this run's results in FILE, ``--check-record`` compiles every case and fails
where FILE records another result under the same key. ``kernels/compile_record.json`` is this
repository's record of every case; the default-tier test reads it, so a machine whose Triton cache is
cold does not spend minutes compiling kernels nobody changed.

It must run with ``TRITON_INTERPRET`` unset (the interpreter replaces the kernels the compiler
needs); the test runs it in a child process for that reason.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType


@dataclass(frozen=True)
class Target:
    name: str
    capability: int
    shared_limit: int  # bytes of shared memory one block may opt in to
    registers_per_sm: int = 65536


# Per-block opt-in shared memory (cudaDevAttrMaxSharedMemoryPerBlockOptin): A100 163 KiB, H100 227 KiB.
TARGETS: Mapping[str, Target] = MappingProxyType({
    "sm_80": Target("sm_80", 80, 166912),
    "sm_90": Target("sm_90", 90, 232448),
})


@dataclass(frozen=True)
class CompileCase:
    """One kernel at one real shape, as its wrapper would launch it."""

    name: str
    kernel: object  # a @triton.jit function (triton.heuristics wrappers are unwrapped)
    signature: Mapping[str, str]  # every argument -> Triton type ("*fp32", "i32", "fp32", "constexpr")
    constexprs: Mapping[str, object]
    num_warps: int = 4
    num_stages: int = 3
    representative: bool = False  # compiled by the default-tier test, the others only by the full sweep


def case(name: str, kernel, *, types: Mapping[str, str], constexprs: Mapping[str, object],
         num_warps: int = 4, num_stages: int = 3, representative: bool = False) -> CompileCase:
    """A case whose non-constexpr arguments are ``types[name]``, or ``"i32"`` when not listed."""
    fn = _jit_function(kernel)
    unknown = (set(types) | set(constexprs)) - set(fn.arg_names)
    assert not unknown, f"{name}: {sorted(unknown)} are not arguments of {fn.__name__}"
    signature = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
    return CompileCase(name, fn, MappingProxyType(signature), MappingProxyType(dict(constexprs)),
                       num_warps, num_stages, representative)


def _jit_function(kernel):
    from triton.runtime.autotuner import Autotuner, Heuristics

    while isinstance(kernel, (Autotuner, Heuristics)):
        kernel = kernel.fn
    return kernel


@dataclass(frozen=True)
class Result:
    case: CompileCase
    target: Target
    shared: int = 0
    registers: int = 0
    spill_bytes: int = 0
    tf32_swizzle: int | None = None  # the narrowest swizzle (bytes) of a float32 wgmma operand; None: none
    error: str | None = None
    problems: tuple[str, ...] = field(default=())
    key: str | None = None  # Triton's cache key of the compile (sha256 hex)
    recorded: bool = False  # read from a record under the same key, not compiled in this run

    @property
    def fits(self) -> bool:
        return self.error is None and not self.problems


def discover_cases(package: str = "kernels") -> list[CompileCase]:
    """Every case from every ``<package>.<op>.compile_cases`` module, in folder order."""
    pkg = importlib.import_module(package)
    cases = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if not info.ispkg:
            continue
        folder = Path(pkg.__path__[0]) / info.name
        if not (folder / "compile_cases.py").exists():
            continue
        module = importlib.import_module(f"{package}.{info.name}.compile_cases")
        cases.extend(module.compile_cases())
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "compile case names must be unique"
    return cases


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) from cuobjdump, which ships with Triton."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
                             capture_output=True, text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return int(regs.group(1)) if regs else 0, int(stack.group(1)) if stack else 0


def _problems(c: CompileCase, target: Target, shared: int, registers: int,
              tf32_swizzle: int | None = None) -> tuple[str, ...]:
    problems = []
    if shared > target.shared_limit:
        problems.append(f"shared memory {shared} > {target.shared_limit}")
    if registers * c.num_warps * 32 > target.registers_per_sm:
        problems.append(f"{registers} registers x {c.num_warps * 32} threads > {target.registers_per_sm}")
    if tf32_swizzle is not None and tf32_swizzle < 128:
        problems.append(f"a float32 wgmma operand with a {tf32_swizzle}-byte swizzle (a tl.dot over fewer "
                        "than 32 float32: the layout of the H100's illegal memory access)")
    return tuple(problems)


_NVMMA = re.compile(r"nvmma_shared<\{swizzlingByteWidth = (\d+)[^}]*elementBitWidth = 32\}>")


def tf32_wgmma_swizzle(ttgir: str) -> int | None:
    """The narrowest swizzle, in bytes, of the float32 operands a compiled kernel stages for ``wgmma``
    (``#ttg.nvmma_shared`` layouts of 32-bit elements in its TTGIR); None when it has none."""
    widths = [int(w) for w in _NVMMA.findall(ttgir)]
    return min(widths) if widths else None


def _source_and_options(c: CompileCase, target: Target):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(c.kernel, dict(c.signature), constexprs=dict(c.constexprs))
    options = {"num_warps": c.num_warps, "num_stages": c.num_stages}
    return src, GPUTarget("cuda", target.capability, 32), options


def cache_key(c: CompileCase, target: Target) -> str:
    """The sha256 Triton files this compile under in its cache, derived as ``triton.compile`` derives
    it, without compiling."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key

    src, gpu_target, options = _source_and_options(c, target)
    backend = make_backend(gpu_target)
    parsed = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, parsed, env_vars=get_cache_invalidating_env_vars())
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _record_id(c: CompileCase, target: Target) -> str:
    return f"{target.name}  {c.name}"


def read_record(path: Path) -> dict[str, dict]:
    """``"<target>  <case>" -> {"key", "shared", "registers", "spill_bytes", "tf32_swizzle"}``; empty when
    absent. An entry without ``tf32_swizzle`` (recorded before that check) is compiled again."""
    return json.loads(path.read_text())["results"] if path.is_file() else {}


def write_record(path: Path, results: list[Result]) -> None:
    """Adds this run's compiled results to the record at ``path`` (entries of other cases stay)."""
    entries = read_record(path)
    for r in results:
        if r.error is None and r.key is not None:
            entries[_record_id(r.case, r.target)] = {
                "key": r.key, "shared": r.shared, "registers": r.registers, "spill_bytes": r.spill_bytes,
                "tf32_swizzle": r.tf32_swizzle}
    import triton

    path.write_text(json.dumps({"triton": triton.__version__, "results": dict(sorted(entries.items()))},
                               indent=1) + "\n")


class Compiler:
    """Compiles cases for targets; each (case, target) once per Compiler. Given a record
    (:func:`read_record`), a case recorded under its Triton cache key is read from it instead."""

    def __init__(self, record: Mapping[str, dict] | None = None):
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            raise RuntimeError(
                "the compile check needs TRITON_INTERPRET unset (the interpreter replaces kernels)"
            )
        self._results: dict[tuple[str, str], Result] = {}
        self._record = record or {}

    def compile(self, c: CompileCase, target: Target) -> Result:
        key = (c.name, target.name)
        if key not in self._results:
            self._results[key] = self._recorded(c, target) or self._compile(c, target)
        return self._results[key]

    def _recorded(self, c: CompileCase, target: Target) -> Result | None:
        entry = self._record.get(_record_id(c, target))
        if entry is None or "tf32_swizzle" not in entry:
            return None
        try:
            key = cache_key(c, target)
        except Exception:  # noqa: BLE001 -- a case whose key cannot be derived is compiled (and reports why)
            return None
        if entry["key"] != key:
            return None
        shared, registers, swizzle = entry["shared"], entry["registers"], entry["tf32_swizzle"]
        return Result(c, target, shared, registers, entry["spill_bytes"], swizzle,
                      problems=_problems(c, target, shared, registers, swizzle), key=key, recorded=True)

    @staticmethod
    def _compile(c: CompileCase, target: Target) -> Result:
        import triton

        try:
            src, gpu_target, options = _source_and_options(c, target)
            compiled = triton.compile(src, target=gpu_target, options=options)
            registers, stack = _resource_usage(compiled.asm["cubin"])
        except Exception as exc:  # noqa: BLE001 -- any compile failure is the finding
            return Result(c, target, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        shared, swizzle = compiled.metadata.shared, tf32_wgmma_swizzle(compiled.asm["ttgir"])
        return Result(c, target, shared, registers, stack, swizzle,
                      problems=_problems(c, target, shared, registers, swizzle), key=compiled.hash)


def format_result(r: Result) -> str:
    status = "ok" if r.fits else "CANNOT LAUNCH"
    if r.error:
        return f"{r.target.name}  {r.case.name:<58} {status}: {r.error}"
    pct = 100 * r.shared / r.target.shared_limit
    spill = f", spills {r.spill_bytes} B" if r.spill_bytes else ""
    spill += ", recorded" if r.recorded else ""
    why = f": {'; '.join(r.problems)}" if r.problems else ""
    return (
        f"{r.target.name}  {r.case.name:<58} shared {r.shared:>6} / {r.target.shared_limit} ({pct:3.0f}%)  "
        f"regs {r.registers:>3} x {r.case.num_warps} warps{spill}  {status}{why}"
    )


def run(targets: list[str], *, match: str | None = None, representative: bool = False,
        package: str = "kernels", record: Path | None = None, write: bool = False, check: bool = False,
        out=sys.stdout) -> list[Result]:
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise SystemExit(f"unknown target(s) {unknown}; known: {', '.join(TARGETS)}")
    if (write or check) and record is None:
        raise SystemExit("--write-record and --check-record need --record FILE")
    cases = [c for c in discover_cases(package) if (match is None or match in c.name)
             and (c.representative or not representative)]
    if not cases:
        raise SystemExit("no compile case matches")
    recorded = read_record(record) if record is not None else {}
    compiler, results = Compiler(None if check else recorded), []
    for c in cases:
        for t in targets:
            results.append(compiler.compile(c, TARGETS[t]))
            print(format_result(results[-1]), file=out, flush=True)
    bad = [r for r in results if not r.fits]
    print(f"{len(results) - len(bad)} of {len(results)} compiled kernels fit their target", file=out)
    if record is not None and not check:
        reused = sum(r.recorded for r in results)
        print(f"{reused} read from {record} (the same Triton cache key), {len(results) - reused} compiled",
              file=out)
    disagreements = _disagreements(results, recorded, out) if check else []
    if write:
        write_record(record, results)
    return results + disagreements


def _disagreements(results: list[Result], recorded: Mapping[str, dict], out) -> list[Result]:
    """The results whose record entry, under the same key, says otherwise (as failed results)."""
    bad = []
    for r in results:
        entry = recorded.get(_record_id(r.case, r.target))
        if entry is None or r.key != entry["key"]:
            continue
        got = {"shared": r.shared, "registers": r.registers, "spill_bytes": r.spill_bytes,
               "tf32_swizzle": r.tf32_swizzle}
        if got != {k: entry.get(k) for k in got}:
            print(f"{_record_id(r.case, r.target)}: the record says {entry}, the compile gives {got}",
                  file=out)
            bad.append(Result(r.case, r.target, error="the record disagrees with the compile"))
    print(f"{len(bad)} record entries disagree with the compile", file=out)
    return bad


def main(argv: list[str] | None = None) -> int:
    # Triton's default (fused multiply-add on), said explicitly: the variable is part of Triton's cache key,
    # so the record's keys are the same whether or not the caller's environment sets it (the test sets it).
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    parser = argparse.ArgumentParser(
        prog="python -m kernels.compile_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--targets", default="sm_80,sm_90", help=f"comma list of {', '.join(TARGETS)}")
    parser.add_argument("--match", default=None, help="only cases whose name contains this text")
    parser.add_argument("--representative", action="store_true",
                        help="only the representative case of each kernel (the default-tier test)")
    parser.add_argument("--package", default="kernels", help="the package whose op folders are searched")
    parser.add_argument("--record", type=Path, default=None,
                        help="reuse the results FILE records under the same Triton cache key (e.g. "
                             "kernels/compile_record.json); compile the others")
    parser.add_argument("--write-record", action="store_true",
                        help="store this run's results in the --record FILE")
    parser.add_argument("--check-record", action="store_true",
                        help="compile every case; fail where the --record FILE differs under the same key")
    args = parser.parse_args(argv)
    results = run([t.strip() for t in args.targets.split(",") if t.strip()], match=args.match,
                  representative=args.representative, package=args.package, record=args.record,
                  write=args.write_record, check=args.check_record)
    return 0 if all(r.fits for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
