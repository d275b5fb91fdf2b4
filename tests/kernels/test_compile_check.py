"""The real-shape compile check: every Triton kernel compiles and fits sm_80 and sm_90, without a GPU.

The check runs in a child process because the test session may have switched Triton to its
interpreter (tests/conftest.py), which replaces the kernels the compiler needs. The default tier
reads kernels/compile_record.json: a case recorded there under the same Triton cache key (the
kernel's source and what it calls, the shapes and options, the target, Triton and ptxas) is not
compiled again, so a machine with a cold Triton cache checks every kernel in seconds; a kernel that
changed is compiled. The slow tier compiles every case and checks that the record agrees.
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
RECORD = REPO / "kernels" / "compile_record.json"
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
    assert len(chunk) == 5, "the five chunked prefill phases are checked at Dk = Dv = 256 as well"
    small = {c.kernel.__name__ for c in representative
             if c.name.startswith("gdn.chunk") and "D=16," in c.name}
    assert small == chunk, "and at the kernel tests' Dk = 16 with float32 inputs, in the default tier"
    proc = compile_check("--targets", "sm_80,sm_90", "--representative", "--record", str(RECORD))
    assert_every_case_fits(proc, [c.name for c in representative])


@pytest.mark.slow
def test_every_case_fits_sm80_and_sm90_and_the_record_agrees():
    from kernels.compile_check import discover_cases

    proc = compile_check("--targets", "sm_80,sm_90", "--record", str(RECORD), "--check-record")
    assert_every_case_fits(proc, [c.name for c in discover_cases()])
    assert "\n0 record entries disagree with the compile" in proc.stdout, proc.stdout


TOO_BIG_OP = '''
import triton
import triton.language as tl

from kernels.compile_check import case


@triton.jit
def product_kernel(x, y, n, M: tl.constexpr, K: tl.constexpr):
    m, k = tl.arange(0, M), tl.arange(0, K)
    acc = tl.zeros((M, M), dtype=tl.float32)
    for i in range(n):
        a = tl.load(x + i * M * K + m[:, None] * K + k[None, :])
        b = tl.load(x + i * M * K + k[:, None] * M + m[None, :])
        acc += tl.dot(a, b)
    tl.store(y + m[:, None] * M + m[None, :], acc)


def compile_cases():
    # The loop's [64, K] and [K, 64] float32 tiles are staged in shared memory, 3 stages deep:
    # 3 x 128 KiB at K = 256. At K = 16 a float32 row of the wgmma operand is 64 bytes: the 64-byte
    # swizzle of the chunk GDN kernels' H100 failure.
    return [case(f"product[K={k}]", product_kernel, types={"x": "*fp32", "y": "*fp32"},
                 constexprs={"M": 64, "K": k}, num_stages=3, representative=True) for k in (16, 32, 256)]
'''


def test_an_op_folder_registers_its_cases_and_a_kernel_that_cannot_fit_fails(tmp_path):
    """A kernel over the shared memory limit, and one whose float32 product reduces over 16 elements (on
    sm_90 its wgmma operand gets the 64-byte swizzle), are refused; compiled, then read from the record."""
    op = tmp_path / "extra_ops" / "product"
    op.mkdir(parents=True)
    (op.parent / "__init__.py").write_text("")
    (op / "__init__.py").write_text("")
    (op / "compile_cases.py").write_text(textwrap.dedent(TOO_BIG_OP))
    record = tmp_path / "record.json"
    for run, recorded in ((["--write-record"], "0 read"), ([], "3 read")):  # compiled, then from the record
        proc = compile_check("--package", "extra_ops", "--targets", "sm_90", "--record", str(record), *run,
                             pythonpath=tmp_path)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out
        assert "sm_90  product[K=32] " in out and out.count(" ok") == 1, out
        assert "product[K=256]" in out and "CANNOT LAUNCH: shared memory" in out and "> 232448" in out, out
        narrow = next(ln for ln in out.splitlines() if "product[K=16]" in ln)
        assert "CANNOT LAUNCH: a float32 wgmma operand with a 64-byte swizzle" in narrow, out
        assert "1 of 3 compiled kernels fit their target" in out
        assert f"{recorded} from {record}" in out, out


def test_unknown_target_is_refused():
    """Refused before anything compiles (so in this process, under the interpreter, too)."""
    from kernels.compile_check import main

    with pytest.raises(SystemExit, match=r"unknown target\(s\) \['sm_75'\]; known: sm_80"):
        main(["--targets", "sm_75"])
