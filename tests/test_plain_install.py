"""``pip install .`` without extras runs the product: ``conformance run``, ``fuzz`` and ``mutate`` and
``refengine generate`` on the embedded model.

The package is built as a wheel from a copy of its sources and installed into a fresh virtual environment
that sees nothing of this one but the distributions the wheel's own ``Requires-Dist`` needs (followed
through their requirements): a folder of links to exactly those, put on its path by a ``.pth`` file. pip
installs the wheel from that folder alone (``--no-index``): a runtime dependency the wheel does not
declare is missing there, and a declared one that this environment lacks fails the install. No network,
no copy of torch.

tests/test_import_graph.py checks the same of every import statement, in the default tier: none names a
module that only an extra installs (``extras_only_modules``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("refengine", "kernels", "conformance", "pyproject.toml", "README.md", "LICENSE")


def _wheel(tmp_path: Path) -> Path:
    """The package's wheel, built (without build isolation, with this environment's setuptools) from a
    copy of its sources, so the checkout gets no build folder."""
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "-w", str(out), str(src)], check=True, capture_output=True, text=True)
    (wheel,) = out.glob("refengine-*.whl")
    return wheel


def _requirements(wheel: Path) -> list[str]:
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def runtime_closure(requirements: list[str], installed_only: bool = False) -> dict:
    """The installed distributions ``requirements`` need (no extras), followed through their own
    requirements; a missing one fails the test, naming it (``installed_only``: is left out)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, metadata.Distribution] = {}
    todo = list(requirements)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = canonicalize_name(req.name)
        if key in found:
            continue
        try:
            found[key] = dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            if installed_only:
                continue
            pytest.fail(f"{req} is a runtime requirement, but this environment does not have it")
        todo.extend(dist.requires or ())
    return found


def _tops(dist: metadata.Distribution) -> set[str]:
    """The top-level files and folders a distribution installed (its modules, data and .dist-info)."""
    return {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")} - {"__pycache__"}


def _expose(dists: dict[str, metadata.Distribution], folder: Path) -> None:
    """Links in ``folder`` to every top-level file and folder of ``dists``."""
    folder.mkdir()
    for dist in dists.values():
        base = Path(dist.locate_file(""))
        for top in _tops(dist):
            if top.endswith(".pth") or (folder / top).exists() or not (base / top).exists():
                continue
            (folder / top).symlink_to(base / top)


def extras_only_modules() -> list[str]:
    """The top-level modules that only the package's extras (test, lint, bench, ...) bring, as far as this
    environment has them: those of their distributions, followed through their requirements, that the
    runtime requirements do not need."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = runtime_closure(project["dependencies"])
    extras = runtime_closure([r for reqs in project["optional-dependencies"].values() for r in reqs], True)
    tops = {Path(t).stem for key, dist in extras.items() if key not in runtime for t in _tops(dist)
            if not t.endswith((".dist-info", ".pth", ".libs", ".data"))}
    return sorted(t for t in tops if t.isidentifier())


def _plain_environment(tmp_path: Path, wheel: Path) -> Path:
    """A fresh virtual environment with the wheel installed without extras; its bin folder."""
    env_dir = tmp_path / "plain"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    deps = tmp_path / "runtime"
    _expose(runtime_closure(_requirements(wheel)), deps)
    (Path(site) / "runtime-dependencies.pth").write_text(f"{deps}\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-index",
                           "--find-links", str(wheel.parent), str(wheel)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return env_dir / "bin"


def _clean_env(tmp_path: Path) -> dict[str, str]:
    """This process's environment without what points into the checkout or this environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
           and not k.startswith(("PYTEST", "CONFORMANCE_"))}
    env["HOME"] = str(tmp_path)  # nothing from the user's configuration
    return env


@pytest.mark.slow  # a wheel build, an install and four commands that load torch: about a minute
def test_a_plain_install_runs_every_command(tmp_path):
    bin_dir = _plain_environment(tmp_path, _wheel(tmp_path))
    env = _clean_env(tmp_path)
    work = tmp_path / "work"
    work.mkdir()

    def run(*argv: str, timeout: float = 300) -> str:
        proc = subprocess.run([str(bin_dir / argv[0]), *argv[1:]], cwd=work, env=env, capture_output=True,
                              text=True, timeout=timeout, check=False)
        assert proc.returncode == 0, f"{' '.join(argv)}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    # the environment is the plain one: the package from the wheel, nothing of the extras
    extras = extras_only_modules()
    assert "xdist" in extras and "junitparser" in extras, extras
    where = run("python", "-c", "import importlib.util as u, refengine; print(refengine.__file__); "
                f"print([m for m in {extras!r} if u.find_spec(m)])")
    assert str(bin_dir.parent) in where.splitlines()[0] and where.splitlines()[1] == "[]", where
    out = run("conformance", "run", "--engine", "async", "--scenario", "short-prompts-k0", "--junit-xml",
              "r.xml")
    assert "1 scenarios" in out and (work / "r.xml").is_file(), out
    out = run("conformance", "fuzz", "--engine", "async", "--examples", "2", "--no-shrink")
    assert "2 workloads" in out, out
    out = run("conformance", "mutate", "--mutant", "short-prompt-as-decode")
    assert "short-prompt-as-decode on" in out and "caught by" in out, out
    out = run("refengine", "generate", "--prompt", "Once upon a time", "--max-tokens", "4")
    assert "finish_reason: length" in out and "4 tokens" in out, out
