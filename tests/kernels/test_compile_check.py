"""The real-shape compile check: every Triton kernel compiles and fits sm_80 and sm_90, without a GPU.

The check runs in a child process because the test session may have switched Triton to its
interpreter (tests/conftest.py), which replaces the kernels the compiler needs. Compiled kernels
land in Triton's cache, so later runs take a few seconds.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HAS_NVIDIA_BACKEND = importlib.util.find_spec("triton") is not None and \
    importlib.util.find_spec("triton.backends.nvidia") is not None
pytestmark = [pytest.mark.cpu_only,
              pytest.mark.skipif(not HAS_NVIDIA_BACKEND, reason="needs triton with its NVIDIA backend")]


def compile_check(*args: str, pythonpath: Path = REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), str(REPO)])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return subprocess.run([sys.executable, "-m", "kernels.compile_check", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, check=False, timeout=900)


def assert_every_case_fits(proc: subprocess.CompletedProcess, names: list[str]) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for name in names:
        for target in ("sm_80", "sm_90"):
            line = next((ln for ln in lines if ln.startswith(f"{target}  {name} ")), None)
            assert line is not None and line.endswith(" ok"), f"{target} {name}: {line}"


def test_representative_case_of_every_kernel_fits_sm80_and_sm90():
    from kernels.compile_check import discover_cases

    cases = discover_cases()
    kernels = {c.kernel.__name__ for c in cases}
    launched = {m.group(1) for f in (REPO / "kernels").glob("*/triton_*.py")
                for m in re.finditer(r"^def (\w+_kernel)\(", f.read_text(), re.MULTILINE)}
    assert launched <= kernels, f"kernels without a compile case: {sorted(launched - kernels)}"
    representative = [c for c in cases if c.representative]
    assert {c.kernel.__name__ for c in representative} == kernels, "every kernel needs a representative case"
    chunk = {c.kernel.__name__ for c in cases if c.name.startswith("gdn.chunk") and "D=256" in c.name}
    assert len(chunk) == 3, "the chunked prefill kernels are checked at Dk = Dv = 256 as well"
    assert_every_case_fits(compile_check("--targets", "sm_80,sm_90", "--representative"),
                           [c.name for c in representative])


@pytest.mark.slow
def test_every_case_fits_sm80_and_sm90():
    from kernels.compile_check import discover_cases

    assert_every_case_fits(compile_check("--targets", "sm_80,sm_90"), [c.name for c in discover_cases()])


TOO_BIG_OP = '''
import triton
import triton.language as tl

from kernels.compile_check import case


@triton.jit
def square_kernel(x, y, B: tl.constexpr):
    o = tl.arange(0, B)
    p = o[:, None] * B + o[None, :]
    a = tl.load(x + p)
    tl.store(y + p, tl.dot(a, a).to(y.dtype.element_ty))


def compile_cases():
    # The [B, B] float32 operands of the product are staged in shared memory: 2 x 256 KiB at B = 256.
    return [case(f"square[B={b}]", square_kernel, types={"x": "*fp32", "y": "*fp32"}, constexprs={"B": b},
                 representative=True) for b in (32, 256)]
'''


def test_an_op_folder_registers_its_cases_and_a_kernel_that_cannot_fit_fails(tmp_path):
    op = tmp_path / "extra_ops" / "square"
    op.mkdir(parents=True)
    (op.parent / "__init__.py").write_text("")
    (op / "__init__.py").write_text("")
    (op / "compile_cases.py").write_text(textwrap.dedent(TOO_BIG_OP))
    proc = compile_check("--package", "extra_ops", "--targets", "sm_90", pythonpath=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "sm_90  square[B=32] " in out and out.count(" ok") == 1, out
    assert "square[B=256]" in out and "CANNOT LAUNCH: shared memory" in out and "> 232448" in out, out
    assert "1 of 2 compiled kernels fit their target" in out


def test_unknown_target_is_refused():
    proc = compile_check("--targets", "sm_75")
    assert proc.returncode != 0 and "unknown target" in proc.stderr
