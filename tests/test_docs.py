"""The READMEs' commands and examples, checked against the code so a wrong tier, flag or default
cannot ship.

Every command in a fenced ``bash`` block (or an unlabelled block of commands) and every inline
command span of the READMEs is extracted and checked by its program: ``refengine`` and
``conformance`` flags parse with the command's own parser (the cheap commands also run),
``pytest`` commands collect at least one test with the markers named in pyproject, scripts accept
their flags, the set-up line names files and extras that exist. The API example runs and its
``LLM(...)`` call is compared with ``inspect.signature(LLM)``; the kernel signatures in
kernels/README.md are compared with the functions.
"""

from __future__ import annotations

import ast
import configparser
import contextlib
import inspect
import io
import itertools
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
READMES = ("README.md", "conformance/README.md", "kernels/README.md", "refengine/README.md")
PROGRAMS = ("refengine", "conformance", "pytest", "python", "python3", "pip", "tox", ".")
# Commands whose flags are checked but which are not run in the default tier, and why.
NOT_RUN = {
    (
        "conformance",
        "run",
    ): "a conformance run takes minutes; its flags are parsed here, the run is tests/conformance",
    (
        "conformance",
        "replay",
    ): "replays a whole scenario; flags parsed here, replay is tested in tests/conformance",
    (
        "conformance",
        "mutate",
    ): "runs the suite once per mutant (slow); tests/conformance/test_mutants.py runs it",
    ("conformance", "fuzz"): "searches generated workloads (minutes); tests/conformance/test_fuzz.py runs it",
    ("conformance", "calibrate"): "runs the corpus per engine and dtype (long); see tests/conformance",
    ("conformance", "triage"): "runs an engine and its controls; tests/conformance/test_triage.py runs it",
    ("refengine", "report"): "times the default workload three times; tests/refengine/test_default_model.py",
    ("refengine", "bench"): "times both engines; tests/refengine/test_bench.py runs bench.run",
    (
        "refengine",
        "add-mtp-head",
    ): "writes a checkpoint folder; tests/refengine/test_mtp_head.py runs it end to end",
    ("refengine", "add-eagle-head"): "writes a head folder; tests/refengine/test_eagle.py runs it end to end",
    (
        "refengine",
        "make-draft-model",
    ): "writes a checkpoint folder; tests/refengine/test_draft_model.py runs it end to end",
    ("python3", "-m"): "creates a virtual environment (set-up, run by .ci/run)",
    (".", ".venv/bin/activate"): "activates the virtual environment (set-up, run by .ci/run)",
    (".", ".venv-vllm/bin/activate"): "activates the vLLM tier's environment (README, Testing vLLM; .ci/run)",
}
# Repository scripts that need hardware this tier lacks: checked to exist, be executable and read
# the environment variables the README sets, never run here.
GPU_ONLY_SCRIPTS = {"ci/gpu_runner.sh": "the GPU runner: needs CUDA"}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


@dataclass(frozen=True)
class Command:
    readme: str
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return " ".join([f"{k}={v}" for k, v in self.env] + [shlex.quote(a) for a in self.argv])


def _blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def _is_command(line: str) -> bool:
    words = line.split()
    while words and re.match(r"^[A-Z_]+=", words[0]):
        words = words[1:]
    return bool(words) and words[0] in PROGRAMS


def _lines(body: str) -> list[str]:
    """Physical lines -> commands: indented lines and trailing backslashes continue the previous one."""
    out: list[str] = []
    for line in body.splitlines():
        if not line.strip():
            continue
        if out and (line[0].isspace() or out[-1].endswith("\\")):
            out[-1] = out[-1].rstrip("\\") + " " + line.strip()
        else:
            out.append(line.strip())
    return out


def _expand(line: str) -> list[list[str]]:
    """A synopsis line -> concrete argument lists: ``[--flag a|b]`` groups are taken with each
    alternative once (the others at their first alternative); ``...`` is dropped."""
    line = line.replace("<graph mode>", "full")
    tokens = shlex.split(line, comments=True)
    items: list[list[list[str]]] = []  # per item: alternatives, each a token list
    i = 0
    while i < len(tokens):
        if not tokens[i].startswith("["):
            items.append([[tokens[i]]])
            i += 1
            continue
        group = []
        while True:
            group.append(tokens[i])
            i += 1
            if group[-1].endswith("]"):
                break
        group = [t.strip("[]") for t in group if t.strip("[]") not in ("...", "")]
        choices = [t.split("|") for t in group]
        count = max(len(c) for c in choices)
        items.append([[c[min(j, len(c) - 1)] for c in choices] for j in range(count)])
    variants = [[t for item in items for t in item[0]]]
    for k, item in enumerate(items):
        for alt in item[1:]:
            variants.append([t for n, it in enumerate(items) for t in (alt if n == k else it[0])])
    return variants


def _split_chain(argv: list[str]) -> list[list[str]]:
    out = [[]]
    for a in argv:
        if a == "&&":
            out.append([])
        else:
            out[-1].append(a)
    return [c for c in out if c]


def _commands(readme: str) -> list[Command]:
    text = (REPO / readme).read_text()
    lines = []
    for info, body in _blocks(text):
        if info in ("bash", "sh"):
            lines += _lines(body)
        elif info == "" and body.strip() and _is_command(body.strip().splitlines()[0]):
            lines += [line for line in _lines(body) if _is_command(line)]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    lines += [span for span in re.findall(r"`([^`\n]+)`", prose) if " " in span and _is_command(span)]
    commands = []
    for line in lines:
        for argv in _expand(line):
            for part in _split_chain(argv):
                env = []
                while part and re.match(r"^[A-Z_]+=", part[0]):
                    key, _, value = part.pop(0).partition("=")
                    env.append((key, value))
                commands.append(Command(readme, tuple(env), tuple(part)))
    return list(dict.fromkeys(commands))


ALL = [c for readme in READMES for c in _commands(readme)]


def test_the_readmes_have_commands():
    programs = {c.argv[0] for c in ALL}
    assert {"refengine", "conformance", "pytest", "pip"} <= programs, programs
    assert any(c.argv[:3] == ("pytest", "-m", "gpu") for c in ALL)


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory) -> dict[str, str]:
    from refengine.llm import default_model_path

    out = tmp_path_factory.mktemp("docs")
    model = default_model_path()
    return {"PATH": model, "CKPT": model, "F": str(out / "report.out"), "SCENARIO": "mtp-k3", "ID": "mtp-k3",
            "K": "3", "N": "1", "S": "5", "E": "async", "DIR": str(out / "fuzz")}


@pytest.fixture(scope="module")
def help_texts() -> dict[tuple[str, ...], str]:
    """``--help`` output per script or module, each asked once."""
    return {}


def _substitute(argv, placeholders) -> list[str]:
    return [placeholders.get(a, a) for a in argv]


def _parse(parser, args: list[str]):
    try:
        return parser.parse_args(args)
    except SystemExit as exc:
        pytest.fail(f"the parser refuses {args}: exit {exc.code}")


def _check_refengine(cmd: Command, args: list[str], capsys) -> None:
    from refengine.tools import bench, cli, report

    assert "refengine" in PYPROJECT["project"]["scripts"]
    sub = args[0]
    parser = {"report": report.build_parser, "bench": bench.build_parser}.get(sub)
    _parse(parser() if parser else cli.build_parser(), args[1:] if parser else args)
    if ("refengine", sub) in NOT_RUN:
        return
    assert cli.main([*args, "--max-tokens", "4"]) == 0, capsys.readouterr()
    assert "tokens/s" in capsys.readouterr().out


def _check_conformance(cmd: Command, args: list[str], capsys) -> None:
    from conformance import cli
    from conformance.workloads import scenario_ids

    assert "conformance" in PYPROJECT["project"]["scripts"]
    ns = _parse(cli.build_parser(), args)
    known = set(scenario_ids("nightly"))
    named = getattr(ns, "scenario", None) or []
    named = named if isinstance(named, list) else [named]  # `run --scenario ID ...` or `replay ID`
    for sid in named:
        assert sid in known, f"{cmd}: unknown scenario {sid!r}"
    if ("conformance", args[0]) in NOT_RUN:
        return
    assert cli.main(args) == 0
    assert capsys.readouterr().out.strip()


class _Collected:
    def __init__(self):
        self.items: list[str] = []

    def pytest_collection_finish(self, session):
        self.items = [item.nodeid for item in session.items]


def _check_pytest(cmd: Command, args: list[str], monkeypatch) -> None:
    markers = {m.split(":")[0].strip() for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    for flag, value in itertools.pairwise(args):
        if flag == "-m":
            named = set(re.findall(r"[A-Za-z_]\w*", value)) - {"and", "or", "not"}
            assert named <= markers, f"{cmd}: marker(s) {named - markers} are not declared in pyproject.toml"
    for key, value in cmd.env:
        if key == "KERNELS_BACKEND":
            from kernels._dispatch import _VALID

            assert value in _VALID, f"{cmd}: KERNELS_BACKEND={value} is not one of {_VALID}"
        monkeypatch.setenv(key, value)
    args = ["0" if (a == "auto" and prev == "-n") else a for prev, a in zip(["", *args], args)]
    grab = _Collected()
    # no:unraisableexception: that plugin ends every session with rounds of gc.collect() over this whole
    # process's heap (seconds per command in a worker that holds models) and plays no part in collection
    quiet = ["-p", "no:cacheprovider", "-p", "no:unraisableexception"]
    code = pytest.main(["--collect-only", "-q", *quiet, *args], plugins=[grab])
    assert code == 0 and grab.items, f"`{cmd}` collects no tests (exit {code})"


def _run_module_help(module: str) -> tuple[object, str, str]:
    """``python -m module --help`` in this process (runpy, with ``sys.argv`` as the interpreter sets
    it): the exit status, stdout and stderr."""
    out, err, argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = [module, "--help"]
    # pytest marks the plugin's distribution (this package) for assertion rewriting, and its import hook
    # has no ``get_code``, which runpy asks the module's finder for: find it as Python itself would
    rewriting = [hook for hook in sys.meta_path if type(hook).__name__ == "AssertionRewritingHook"]
    for hook in rewriting:
        sys.meta_path.remove(hook)
    # an earlier import's spec (runpy reads it from sys.modules) may name such a hook as its loader: set
    # the module aside while runpy finds it afresh
    imported = sys.modules.pop(module, None)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            # the module may be imported already (by another test): runpy then says so, harmlessly
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code
    finally:
        sys.argv = argv
        sys.meta_path[:0] = rewriting
        if imported is not None:
            sys.modules[module] = imported
    return code, out.getvalue(), err.getvalue()


def test_a_module_imported_through_a_loader_without_get_code_still_answers_help(monkeypatch):
    """In one process running the whole tier (``-n 0``), a module may have been imported by an earlier
    in-process pytest session whose rewriting hook, without ``get_code``, became its spec's loader."""
    import importlib.machinery

    import kernels.compile_check as module

    hookless = importlib.machinery.ModuleSpec(module.__name__, loader=object(), origin=module.__file__)
    monkeypatch.setattr(module, "__spec__", hookless)
    code, stdout, _ = _run_module_help(module.__name__)
    assert code == 0 and "--targets" in stdout
    assert sys.modules[module.__name__] is module


def _check_python(cmd: Command, args: list[str], help_texts) -> None:
    """``python script.py`` or ``python -m module``: it answers ``--help`` and knows every flag given."""
    if args[0] == "-m":
        target, rest = ("-m", args[1]), args[2:]
    else:
        assert (REPO / args[0]).is_file(), f"{cmd}: no {args[0]}"
        target, rest = (args[0],), args[1:]
    if target not in help_texts:
        if target[0] == "-m":  # the module's __main__ run here as `python -m` runs it: no second torch import
            code, stdout, stderr = _run_module_help(target[1])
        else:  # a script imports its folder's modules (sys.path[0]): its own interpreter
            proc = subprocess.run([sys.executable, *target, "--help"], cwd=REPO, capture_output=True,
                                  text=True, timeout=120, check=False)
            code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        assert code == 0, f"{cmd}: --help exits {code}: {stderr[-500:]}"
        help_texts[target] = stdout
    for flag in (a for a in rest if a.startswith("--")):
        assert flag.split("=")[0] in help_texts[target], f"{cmd}: {' '.join(target)} has no {flag}"


def _check_script(cmd: Command, program: str) -> None:
    assert program in GPU_ONLY_SCRIPTS, f"{cmd}: no check for {program}; declare it in GPU_ONLY_SCRIPTS"
    script = REPO / program
    assert script.is_file() and script.stat().st_mode & 0o111, f"{cmd}: {program} is not an executable file"
    text = script.read_text()
    for key, _ in cmd.env:
        assert re.search(rf"\b{key}\b", text), f"{cmd}: {program} does not read {key}"


def _check_pip(cmd: Command, args: list[str]) -> None:
    assert args[0] == "install"
    extras = PYPROJECT["project"]["optional-dependencies"]
    for flag, value in itertools.pairwise(args):
        if flag == "-c":
            assert (REPO / value).is_file(), f"{cmd}: no constraints file {value}"
            pins = {line.strip() for line in (REPO / value).read_text().splitlines()}
            for req in (a for a in args if "==" in a):
                assert req in pins, f"{cmd}: {req} is not the pin in {value}"
        if flag == "-e":
            wanted = re.fullmatch(r"\.\[([\w,]+)\]", value)
            assert wanted, value
            missing = set(wanted.group(1).split(",")) - set(extras)
            assert not missing, f"{cmd}: no extra(s) {missing} in pyproject.toml"


@pytest.mark.filterwarnings("ignore:Benchmarks are automatically disabled")
@pytest.mark.parametrize("cmd", ALL, ids=[f"{c.readme}:{c}"[:120] for c in ALL])
def test_command(cmd, placeholders, capsys, monkeypatch, help_texts):
    program, *args = _substitute(cmd.argv, placeholders)
    if (program, args[0] if args else "") in NOT_RUN and program not in ("refengine", "conformance"):
        return  # set-up steps, declared in NOT_RUN with the reason
    if program == "refengine":
        _check_refengine(cmd, args, capsys)
    elif program == "conformance":
        _check_conformance(cmd, args, capsys)
    elif program == "pytest":
        _check_pytest(cmd, args, monkeypatch)
    elif program in ("python", "python3"):
        _check_python(cmd, args, help_texts)
    elif program == "pip":
        _check_pip(cmd, args)
    elif program == "tox":
        ini = configparser.ConfigParser(interpolation=None)
        ini.read(REPO / "tox.ini")
        env = args[args.index("-e") + 1]
        assert all(e in ini["tox"]["env_list"] or f"testenv:{e}" in ini for e in env.split(",")), str(cmd)
    elif "/" in program and (REPO / program).exists():
        _check_script(cmd, program)
    else:
        pytest.fail(f"{cmd.readme}: no check for `{cmd}`; add one here or declare it in NOT_RUN")


def test_ci_runs_the_readmes_test_command():
    """README.md says `.ci/run` runs exactly its test command."""
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    test_blocks = [
        body.strip() for info, body in _blocks(readme) if info == "bash" and body.startswith("pytest")
    ]
    assert test_blocks and test_blocks[0] in ci.splitlines()


# ---- the API example --------------------------------------------------------------------------------


def _api_example() -> str:
    text = (REPO / "README.md").read_text()
    return next(body for info, body in _blocks(text) if info == "python" and "LLM(" in body)


def _documented_call(source: str, name: str) -> ast.Call:
    return next(node for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == name)


def test_the_api_example_shows_every_argument_at_its_default():
    from refengine import LLM

    call = _documented_call(_api_example(), "LLM")
    documented = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    params = inspect.signature(LLM).parameters
    wrong = {
        k: (v, params[k].default) for k, v in documented.items() if k in params and v != params[k].default
    }
    assert not wrong, f"README default (documented, actual): {wrong}"
    assert list(documented) == list(params), "the README's LLM(...) lists other arguments than LLM, in order"


def test_the_api_example_names_the_graph_modes():
    from refengine.config import GRAPH_MODES

    line = next(line for line in _api_example().splitlines() if "graph_mode=" in line)
    assert tuple(re.findall(r'"(\w+)"', line.split("#", 1)[1])) == GRAPH_MODES


def test_the_api_example_runs():
    namespace: dict = {}
    exec(compile(_api_example(), "README.md", "exec"), namespace)  # noqa: S102 (the README's own example)
    assert namespace["o"].finish_reason in ("length", "stop") and namespace["o"].token_ids


# ---- kernels/README.md signatures -----------------------------------------------------------------------


def _kernel_signatures() -> list[tuple[str, ast.arguments]]:
    text = (REPO / "kernels" / "README.md").read_text()
    out = []
    for _, body in _blocks(text):
        source = re.sub(r"#[^\n]*", "", body)
        for m in re.finditer(r"(\w+)\(((?:[^()]|\([^()]*\))*)\)", source):
            try:
                out.append((m.group(1), ast.parse(f"def f({m.group(2)}): pass").body[0].args))
            except SyntaxError:
                continue
    return out


@pytest.mark.parametrize("name,documented", _kernel_signatures(), ids=[n for n, _ in _kernel_signatures()])
def test_kernel_signatures_match_the_readme(name, documented):
    import kernels
    import kernels.input_prep

    fn = getattr(kernels, name, None) or getattr(kernels.input_prep, name)
    params = list(inspect.signature(fn).parameters.values())
    positional = [a.arg for a in documented.args]
    keyword = [a.arg for a in documented.kwonlyargs]
    assert [p.name for p in params if p.kind is not p.KEYWORD_ONLY] == positional
    assert [p.name for p in params if p.kind is p.KEYWORD_ONLY] == keyword
    for arg, default in zip(documented.kwonlyargs, documented.kw_defaults):
        actual = inspect.signature(fn).parameters[arg.arg].default
        if default is None:
            assert actual is inspect.Parameter.empty, (
                f"{name}: README gives {arg.arg} no default, it has {actual!r}"
            )
        else:
            assert ast.literal_eval(default) == actual, f"{name}: {arg.arg} defaults to {actual!r}"


# ---- conformance/README.md expected-failures example ------------------------------------------------------


def test_the_expected_failures_example_names_real_scenarios_and_checks(tmp_path):
    from conformance.checks import CHECK_NAMES
    from conformance.expectations import load_expectations, unknown_entries
    from conformance.workloads import scenario_ids

    text = (REPO / "conformance" / "README.md").read_text()
    (example,) = [body for info, body in _blocks(text) if info == "toml"]
    (tmp_path / "example.toml").write_text(example)
    exp = load_expectations(tmp_path / "example.toml")
    assert len(exp.entries) == example.count(" = ")
    assert unknown_entries(exp, scenario_ids("nightly"), CHECK_NAMES) == []


# ---- conformance/README.md table of checks, against the checks' declarations ------------------------------
CHECKS_HEADER = "| check | over | passes when |"


def _check_rows(readme: str) -> list[str]:
    """The rows of the table of checks, as written."""
    after = readme.split("\n" + CHECKS_HEADER + "\n", 1)[1].splitlines()[1:]  # past the |---| line
    return list(itertools.takewhile(lambda line: line.startswith("|"), after))


def _declared_row(c) -> str:
    return f"| `{c.name}` | {', '.join(c.reads)} | {c.passes_when} |"


def checks_table_drift(readme: str, declared) -> list[str]:
    """What the README's table of checks gets wrong about the declarations (empty: nothing)."""
    have, want = _check_rows(readme), [_declared_row(c) for c in declared]
    problems = [f"README lacks this row (or words it otherwise):\n{row}" for row in want if row not in have]
    problems += [f"README row matches no declaration:\n{row}" for row in have if row not in want]
    if not problems and have != want:
        problems.append("the rows are not in report order: " + ", ".join(c.name for c in declared))
    return problems


def test_the_table_of_checks_is_the_declarations():
    """Every declared check has its row, in report order: its name, the traces it reads (``reads``) and
    what it asserts (``passes_when``), word for word; no row names a check that is not declared."""
    from conformance.checks import declared

    problems = checks_table_drift((REPO / "conformance" / "README.md").read_text(), declared())
    assert not problems, "\n\n".join(problems)


def test_the_table_of_checks_test_sees_drift():
    """An edited row, a row out of order and a check declared without a row each fail the test above."""
    from conformance.checks import check, declared, declaring

    readme = (REPO / "conformance" / "README.md").read_text()
    row = next(r for r in _check_rows(readme) if r.startswith("| `state-slots` |"))
    assert checks_table_drift(readme.replace(row, row.replace("| test |", "| ref, test |")), declared())
    assert checks_table_drift(readme.replace(row, row.replace("one step", "a step")), declared())
    rows = _check_rows(readme)
    swapped = readme.replace(rows[0] + "\n" + rows[1], rows[1] + "\n" + rows[0])
    assert checks_table_drift(swapped, declared()) == [
        "the rows are not in report order: " + ", ".join(c.name for c in declared())
    ]
    with declaring():
        check("undocumented", reads=("test",), passes_when="a row nobody wrote")(lambda c: None)
        (problem,) = checks_table_drift(readme, declared())
    assert problem.endswith("| `undocumented` | test | a row nobody wrote |")
    assert checks_table_drift(readme, declared()) == []


# ---- set-up off this machine: the CPU torch from the PyTorch CPU wheel index ---------------------------
CPU_WHEEL_INDEX = "https://download.pytorch.org/whl/cpu"


def test_the_set_up_takes_torch_from_the_cpu_wheel_index():
    """PyPI alone resolves ``torch==2.13.0`` to the CUDA build on Linux: the README gives the set-up line
    for pip's configured index and, for a machine whose only index is PyPI, the same line (still the
    virtual environment and two installs, torch first) naming the PyTorch CPU wheel index; ``tox -e cpu``
    names that index too."""
    readme = (REPO / "README.md").read_text()
    setups = [body for info, body in _blocks(readme)
              if info == "bash" and "venv" in body and ".venv-vllm" not in body]  # the vLLM tier's own
    assert len(setups) == 2, setups  # the configured index's, then the public registry's
    indexes = []
    for setup in setups:
        steps = _split_chain(shlex.split(setup))
        installs = [s for s in steps if s[:2] == ["pip", "install"]]
        assert len(installs) == 2 and len(steps) == 4, setup  # venv, activate, torch, the package
        assert any(a.startswith("torch==") for a in installs[0]), setup  # the pinned torch first
        assert "--index-url" not in installs[1], setup  # only torch comes from the CPU index
        indexes.append(installs[0][installs[0].index("--index-url") + 1] if "--index-url" in installs[0]
                       else None)
    assert indexes == [None, CPU_WHEEL_INDEX]
    ini = configparser.ConfigParser(interpolation=None)
    ini.read(REPO / "tox.ini")
    for env in ("testenv:cpu", "testenv:nightly"):
        assert "{[cpu_index]set_env}" in ini[env]["set_env"], env
    index = dict(line.split(" = ", 1) for line in ini["cpu_index"]["set_env"].strip().splitlines())
    assert index["PIP_INDEX_URL"] == "{env:PYTORCH_INDEX_URL:" + CPU_WHEEL_INDEX + "}"
    assert index["PIP_EXTRA_INDEX_URL"] == "https://pypi.org/simple"  # every other package
