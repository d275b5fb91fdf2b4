"""The training corpus of the embedded default model, built offline from what ships with Python.

Three sources, in a fixed order so the same interpreter always yields the same corpus:

- prose: docstrings of the standard library's own modules (read with ``ast``, nothing is imported),
  the Zen of Python (``this.py`` holds it rot13-encoded) and the interpreter's LICENSE.txt;
- synthetic lines from a small grammar (counting, number words, the alphabet, repeated phrases,
  templated sentences), so some prompts have a highly predictable continuation.

Documents are ASCII only and end with the EOS token. Modules in ``HELD_OUT_MODULES`` are left out
of training: the default workload's prose prompts are taken from them.
"""

from __future__ import annotations

import ast
import codecs
import random
import sysconfig
from pathlib import Path

HELD_OUT_MODULES = ("textwrap.py", "fractions.py", "calendar.py", "sched.py", "shlex.py")
SKIP_DIRS = {
    "site-packages",
    "test",
    "tests",
    "idle_test",
    "__pycache__",
    "lib2to3",
    "turtledemo",
    "ensurepip",
}
MIN_DOC_CHARS = 60
NUMBER_WORDS = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
)
COLORS = ("red", "blue", "green", "black", "white", "small", "big", "old", "young", "happy")
ANIMALS = ("cat", "dog", "fox", "bird", "horse", "mouse", "cow", "fish")
PLACES = ("the mat", "the hill", "the house", "the tree", "the road", "the river", "the garden")
VERBS = ("sat on", "ran to", "looked at", "jumped over", "walked to", "slept under")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_prose(text: str) -> bool:
    if len(text) < MIN_DOC_CHARS or not text.isascii() or ">>>" in text:
        return False
    wordy = sum(c.isalpha() or c in " \n.,'" for c in text)
    return wordy / len(text) > 0.85


def docstrings(
    root: Path, exclude: tuple[str, ...] = HELD_OUT_MODULES, max_files: int | None = None
) -> list[str]:
    """Prose docstrings of every module under ``root`` (sorted walk; the first ``max_files`` files
    when given), one document each."""
    docs = []
    for path in sorted(root.rglob("*.py"))[:max_files]:
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or str(rel) in exclude:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc and _is_prose(doc):
                    docs.append(doc.strip())
    return docs


def zen_of_python(root: Path) -> str:
    """The text ``import this`` prints, decoded from this.py without importing it."""
    tree = ast.parse((root / "this.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "s":
            return codecs.decode(node.value.value, "rot13")
    raise ValueError("this.py: no encoded text found")


def license_text(root: Path) -> str | None:
    path = root / "LICENSE.txt"
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    return text if text.isascii() else text.encode("ascii", errors="ignore").decode()


def synthetic_lines(rng: random.Random, count: int) -> list[str]:
    """Short documents from a tiny grammar; every line continues in an obvious way."""
    lines = []
    for _ in range(count):
        kind = rng.randrange(7)
        if kind == 0:
            start, n = rng.randrange(0, 200), rng.randrange(8, 30)
            lines.append(" ".join(str(i) for i in range(start, start + n)))
        elif kind == 1:
            start = rng.randrange(0, 10)
            lines.append(" ".join(NUMBER_WORDS[start: start + rng.randrange(6, 12)]))
        elif kind == 2:
            letters = "abcdefghijklmnopqrstuvwxyz"
            letters = letters.upper() if rng.random() < 0.5 else letters
            start = rng.randrange(0, 10)
            lines.append(" ".join(letters[start:]) if rng.random() < 0.5 else letters[start:])
        elif kind == 3:
            phrase = (
                f"the {rng.choice(COLORS)} {rng.choice(ANIMALS)} {rng.choice(VERBS)} {rng.choice(PLACES)}."
            )
            lines.append(" ".join([phrase] * rng.randrange(2, 5)))
        elif kind == 4:
            animal = rng.choice(ANIMALS)
            lines.append(f"Once upon a time there was a {rng.choice(COLORS)} {animal}. "
                         f"The {animal} {rng.choice(VERBS)} {rng.choice(PLACES)}. "
                         f"Then the {animal} {rng.choice(VERBS)} {rng.choice(PLACES)}. The end.")
        elif kind == 5:
            n = rng.randrange(2, 10)
            lines.append(" ".join(f"{n} times {i} is {n * i}." for i in range(1, rng.randrange(5, 11))))
        else:
            word = rng.choice(ANIMALS + COLORS)
            lines.append(", ".join([word] * rng.randrange(4, 12)) + ".")
    return lines


def build_documents(seed: int = 0, synthetic_fraction: float = 0.2, root: Path | None = None,
                    max_files: int | None = None) -> list[str]:
    """All documents in a deterministic shuffled order; about ``synthetic_fraction`` of the
    characters come from the synthetic grammar. ``max_files`` limits the docstring walk (tests)."""
    root = stdlib_dir() if root is None else root
    prose = docstrings(root, max_files=max_files) + [zen_of_python(root)]
    lic = license_text(root)
    if lic:
        prose += [p.strip() for p in lic.split("\n\n") if len(p.strip()) >= MIN_DOC_CHARS]
    rng = random.Random(seed)
    prose_chars = sum(len(d) for d in prose)
    synth: list[str] = []
    synth_chars = 0
    while synth_chars < prose_chars * synthetic_fraction / (1 - synthetic_fraction):
        lines = synthetic_lines(rng, 500)
        synth += lines
        synth_chars += sum(len(d) for d in lines)
    docs = prose + synth
    rng.shuffle(docs)
    return docs
