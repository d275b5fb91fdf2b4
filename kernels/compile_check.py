"""Compile every Triton kernel for NVIDIA targets at real model shapes, without a GPU.

    python -m kernels.compile_check --targets sm_80,sm_90 [--match TEXT] [--representative]

Each op folder declares its cases in ``kernels/<op>/compile_cases.py``: a function
``compile_cases() -> list[CompileCase]``, discovered here by folder, so a new op registers its
kernels by adding that one module. Every case is compiled with Triton's own compiler for each
target (``triton.compile`` with a ``GPUTarget``; ptxas ships with Triton, no driver is needed), and
the report gives the shared memory the launch needs against the target's per-block opt-in limit,
the registers per thread and the spill (stack) bytes. The command exits 1 when a case cannot launch
on a target: shared memory over the limit, more registers than the SM has for the block, or a
compile error.

It must run with ``TRITON_INTERPRET`` unset (the interpreter replaces the kernels the compiler
needs); the test runs it in a child process for that reason.
"""

from __future__ import annotations

import argparse
import importlib
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
    error: str | None = None
    problems: tuple[str, ...] = field(default=())

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


class Compiler:
    """Compiles cases for targets; each (case, target) once per Compiler."""

    def __init__(self):
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            raise RuntimeError(
                "the compile check needs TRITON_INTERPRET unset (the interpreter replaces kernels)"
            )
        self._results: dict[tuple[str, str], Result] = {}

    def compile(self, c: CompileCase, target: Target) -> Result:
        key = (c.name, target.name)
        if key not in self._results:
            self._results[key] = self._compile(c, target)
        return self._results[key]

    @staticmethod
    def _compile(c: CompileCase, target: Target) -> Result:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        try:
            src = ASTSource(c.kernel, dict(c.signature), constexprs=dict(c.constexprs))
            compiled = triton.compile(src, target=GPUTarget("cuda", target.capability, 32),
                                      options={"num_warps": c.num_warps, "num_stages": c.num_stages})
            registers, stack = _resource_usage(compiled.asm["cubin"])
        except Exception as exc:  # noqa: BLE001 -- any compile failure is the finding
            return Result(c, target, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        shared = compiled.metadata.shared
        problems = []
        if shared > target.shared_limit:
            problems.append(f"shared memory {shared} > {target.shared_limit}")
        if registers * c.num_warps * 32 > target.registers_per_sm:
            problems.append(f"{registers} registers x {c.num_warps * 32} threads > {target.registers_per_sm}")
        return Result(c, target, shared, registers, stack, problems=tuple(problems))


def format_result(r: Result) -> str:
    status = "ok" if r.fits else "CANNOT LAUNCH"
    if r.error:
        return f"{r.target.name}  {r.case.name:<58} {status}: {r.error}"
    pct = 100 * r.shared / r.target.shared_limit
    spill = f", spills {r.spill_bytes} B" if r.spill_bytes else ""
    why = f": {'; '.join(r.problems)}" if r.problems else ""
    return (
        f"{r.target.name}  {r.case.name:<58} shared {r.shared:>6} / {r.target.shared_limit} ({pct:3.0f}%)  "
        f"regs {r.registers:>3} x {r.case.num_warps} warps{spill}  {status}{why}"
    )


def run(targets: list[str], *, match: str | None = None, representative: bool = False,
        package: str = "kernels", out=sys.stdout) -> list[Result]:
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise SystemExit(f"unknown target(s) {unknown}; known: {', '.join(TARGETS)}")
    cases = [c for c in discover_cases(package) if (match is None or match in c.name)
             and (c.representative or not representative)]
    if not cases:
        raise SystemExit("no compile case matches")
    compiler, results = Compiler(), []
    for c in cases:
        for t in targets:
            results.append(compiler.compile(c, TARGETS[t]))
            print(format_result(results[-1]), file=out, flush=True)
    bad = [r for r in results if not r.fits]
    print(f"{len(results) - len(bad)} of {len(results)} compiled kernels fit their target", file=out)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernels.compile_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--targets", default="sm_80,sm_90", help=f"comma list of {', '.join(TARGETS)}")
    parser.add_argument("--match", default=None, help="only cases whose name contains this text")
    parser.add_argument("--representative", action="store_true",
                        help="only the representative case of each kernel (the default-tier test)")
    parser.add_argument("--package", default="kernels", help="the package whose op folders are searched")
    args = parser.parse_args(argv)
    results = run([t.strip() for t in args.targets.split(",") if t.strip()], match=args.match,
                  representative=args.representative, package=args.package)
    return 0 if all(r.fits for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
