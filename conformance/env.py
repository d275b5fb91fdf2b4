"""The environment a run happened in, for report headers and JUnit properties."""

from __future__ import annotations

import importlib.util
import platform
import re
import sys
from importlib import metadata
from pathlib import Path


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _built_cuda() -> str:
    """The CUDA version torch was built for, read from torch/version.py without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return "none"
    text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    match = re.search(r"^cuda(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return match.group(1) if match else "none"


def environment(probe_device: bool = True) -> dict[str, str]:
    """torch, triton, CUDA and device. ``probe_device=False`` avoids importing torch just for this."""
    info = {"python": platform.python_version(), "torch": _version("torch"), "triton": _version("triton")}
    if not probe_device and "torch" not in sys.modules:
        cuda = _built_cuda()
        info.update(cuda=cuda, device="cpu" if cuda == "none" else "not probed (CUDA build)")
        return info
    import torch

    info["cuda"] = torch.version.cuda or "none"
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        info["device"] = torch.cuda.get_device_name(0) + (f" (x{n})" if n > 1 else "")
    else:
        info["device"] = "cpu"
    return info


def describe(info: dict[str, str]) -> str:
    return (f"torch {info['torch']}, triton {info['triton']}, CUDA {info['cuda']}, device {info['device']}, "
            f"python {info['python']}")
