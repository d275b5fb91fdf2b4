"""Print the torch / triton / CUDA / device environment and assert it is the one a job expects.

  python ci/check_env.py                         print only
  python ci/check_env.py --device cpu            torch must be a CPU build (or see no GPU)
  python ci/check_env.py --device cuda --cuda 12.8
  python ci/check_env.py --factor cu128          the same, from a tox factor name
  python ci/check_env.py --dry-run --cuda 12.8   what a GPU runner checks that needs no GPU (see below)

EXPECTED_CUDA / EXPECTED_DEVICE in the environment are used when the flags are absent. A tox
environment that silently resolved torch to another build (PyPI's CUDA wheel in a CPU job, a cu126
wheel in the cu128 job) stops here instead of producing confusing test results.

``--dry-run`` (``ci/gpu_runner.sh --dry-run``) checks what it can without a GPU: Python 3.11 or newer,
torch and triton importable, the expected CUDA version well formed (``12.8``) and served by a ``cuXYZ``
environment of tox.ini; the GPU and the torch CUDA build a real run requires are reported, not required.
"""

from __future__ import annotations

import argparse
import os
import re
import sys


def factor_to_cuda(factor: str) -> str:
    """``cu128`` -> ``12.8``, ``cu130`` -> ``13.0``."""
    match = re.fullmatch(r"cu(\d+)(\d)", factor)
    if not match:
        raise ValueError(f"not a CUDA factor: {factor!r} (expected e.g. cu128)")
    return f"{int(match.group(1))}.{match.group(2)}"


def probe() -> dict[str, str]:
    import torch

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not installed"
    if torch.cuda.is_available():
        info["device"] = "cuda"
        info["gpus"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    else:
        info["device"] = "cpu"
    return info


def problems(info: dict[str, str], cuda: str | None, device: str | None) -> list[str]:
    out = []
    if cuda is not None and info["cuda"] != cuda:
        out.append(f"torch {info['torch']} is built for CUDA {info['cuda']}, this job expects CUDA {cuda} "
                   "(check PYTORCH_INDEX_URL / PIP_INDEX_URL: pip may have picked another index's wheel)")
    if device == "cpu" and info["cuda"] != "none" and info["device"] == "cuda":
        out.append(f"expected a CPU job, but torch {info['torch']} sees GPUs: {info.get('gpus')}")
    if device == "cuda" and info["device"] != "cuda":
        out.append(f"expected a GPU, but torch {info['torch']} (CUDA {info['cuda']}) sees none")
    return out


TOX_INI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tox.ini")


def tox_cuda_envs(path: str = TOX_INI) -> dict[str, str]:
    """The CUDA environments of tox.ini: ``{"cu128": "12.8", ...}``."""
    with open(path) as f:
        names = re.findall(r"^\[testenv:(cu\d+)\]", f.read(), re.MULTILINE)
    return {name: factor_to_cuda(name) for name in names}


def dry_run_problems(info: dict[str, str], cuda: str | None, tox_envs: dict[str, str]) -> list[str]:
    """What a GPU runner would refuse that this machine can tell without a GPU."""
    out = []
    if tuple(int(x) for x in info["python"].split(".")[:2]) < (3, 11):
        out.append(f"Python {info['python']}: the package needs 3.11 or newer")
    if info["triton"] == "not installed":
        out.append("triton is not installed: the GPU kernels are Triton kernels")
    if cuda is None:
        out.append("no expected CUDA version: set EXPECTED_CUDA (e.g. 12.8) or pass --cuda")
    elif not re.fullmatch(r"\d+\.\d", cuda):
        out.append(f"EXPECTED_CUDA={cuda!r} is not a CUDA version such as 12.8")
    elif cuda not in tox_envs.values():
        envs = ", ".join(f"{name} ({v})" for name, v in tox_envs.items())
        out.append(f"no tox environment installs torch for CUDA {cuda} (tox.ini has {envs})")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cuda", default=os.environ.get("EXPECTED_CUDA"), help="expected torch.version.cuda, e.g. 12.8"
    )
    p.add_argument("--factor", default=None, help="tox CUDA factor, e.g. cu128 (sets --cuda)")
    p.add_argument("--device", default=os.environ.get("EXPECTED_DEVICE"), choices=("cpu", "cuda"))
    p.add_argument("--dry-run", action="store_true",
                   help="check what needs no GPU; report the GPU checks without requiring them")
    args = p.parse_args(argv)
    cuda = factor_to_cuda(args.factor) if args.factor else (args.cuda or None)
    info = probe()
    for key, value in info.items():
        print(f"{key:>7}: {value}")
    if args.dry_run:
        tox_envs = tox_cuda_envs()
        print(f"    tox: {', '.join(name for name, v in tox_envs.items() if v == cuda) or 'none'} "
              f"(for CUDA {cuda})")
        for line in problems(info, cuda, args.device):
            print(f"check_env: a GPU run would stop here: {line}")
        found = dry_run_problems(info, cuda, tox_envs)
    else:
        found = problems(info, cuda, args.device)
    for line in found:
        print(f"check_env: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
