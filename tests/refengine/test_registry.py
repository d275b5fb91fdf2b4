"""A model family is one registry entry: the engines, the scheduler, the prefix cache and the cache
allocation never name a family or a mixer, and a family registered here (not in refengine) runs on
both engines untouched."""

from __future__ import annotations

import ast
import dataclasses
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import refengine
from refengine import LLM, SamplingParams
from refengine.model import CheckpointError, load_model, registry
from refengine.model.family import ModelFamily
from refengine.model.layers import Linear
from refengine.model.nemotron_h.config import NemotronHConfig
from refengine.model.nemotron_h.mamba2 import Mamba2Mixer
from refengine.model.nemotron_h.model import Attention
from tests.helpers.driver import greedy_generate

ROOT = Path(refengine.__file__).parent
ENGINE_SIDE = ["reference", "async_engine", "scheduler.py", "prefix_cache", "cache.py", "core.py"]
# The model package's family-agnostic modules: the registry and the cache declarations.
ALLOWED_MODEL_IMPORTS = {"refengine.model.registry", "refengine.model.cache_specs"}
# Words only a family or a mixer would bring (``mamba_cache_mode`` is a generic engine option).
FORBIDDEN_WORDS = ("qwen", "nemotron", "mamba2", "deltanet", "gated_delta", "linear_attention",
                   "full_attention", "layer_types", "mixer_class", "mtp_cache_key")


def engine_side_files() -> list[Path]:
    files = []
    for name in ENGINE_SIDE:
        path = ROOT / name
        assert path.exists(), f"{path} is gone: name its successor in ENGINE_SIDE"
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


def family_words() -> set[str]:
    words = set(FORBIDDEN_WORDS)
    for family in registry.FAMILIES:
        words.add(family.name.lower())
        words.update(t.lower() for t in family.model_types)
    return words


def violations(source: str) -> list[str]:
    """Imports of family modules, and identifiers / string literals naming a family or a mixer."""
    found = []
    words = family_words()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            allowed = any(m in ALLOWED_MODEL_IMPORTS for m in modules)
            if node.module.startswith("refengine.model") and not allowed:
                found.append(f"imports {node.module}")
        elif isinstance(node, ast.Import):
            found.extend(f"imports {a.name}" for a in node.names
                         if a.name.startswith("refengine.model") and a.name not in ALLOWED_MODEL_IMPORTS)
        texts = []
        if isinstance(node, ast.Name):
            texts.append(node.id)
        elif isinstance(node, ast.Attribute):
            texts.append(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts.append(node.value)
        elif isinstance(node, ast.alias):
            texts.extend(n for n in (node.name, node.asname) if n)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef | ast.arg):
            texts.append(node.name if not isinstance(node, ast.arg) else node.arg)
        for text in texts:
            found.extend(f"names {w!r} ({text[:60]!r})" for w in words if w in text.lower())
    return found


def test_engines_scheduler_and_caches_name_no_family_or_mixer():
    problems = {str(f.relative_to(ROOT)): v for f in engine_side_files() if (v := violations(f.read_text()))}
    assert not problems, problems


def test_the_scan_finds_a_family_name():
    """The check above has teeth: the cache allocation as it once was (asking the Qwen mixers and the
    Qwen MTP key directly) is refused."""
    old = ("from refengine.model.qwen3_next.mixers import mixer_class\n"
           "from refengine.model.qwen3_next.model import MTP_CACHE_KEY\n"
           "spec = mixer_class(cfg.layer_types[0])\n")
    found = violations(old)
    assert any("imports refengine.model.qwen3_next.mixers" in v for v in found)
    assert any("'layer_types'" in v for v in found) and any("'mtp_cache_key'" in v for v in found)


# ---- a family that lives in this test only ---------------------------------------------------------
TOY_TYPE = "toy_hybrid"


def toy_config(d: dict) -> NemotronHConfig:
    """A two-layer model: a Mamba2 mixer, then attention; sizes from config.json."""
    return NemotronHConfig(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], block_kinds=["mamba", "attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, mamba_num_heads=4, mamba_head_dim=4,
        ssm_state_size=8, n_groups=2, conv_kernel=3, chunk_size=8, intermediate_size=0,
        max_position_embeddings=256, model_type=TOY_TYPE,
    )


class ToyModel(nn.Module):
    mtp = None

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size,
                                                                                       cfg.hidden_size))
        self.scan = Mamba2Mixer(cfg)
        self.attn = Attention(cfg)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, input_ids, positions, ctx):  # [T] -> [T, H]
        x = self.embed(input_ids)
        x = x + self.scan(x, positions, ctx, "scan")
        return x + self.attn(x, positions, ctx, "attn")

    def compute_logits(self, hidden):
        return self.head(hidden).float()

    def tie_weights(self) -> None:
        return None


@dataclass(frozen=True)
class ToyWeights:
    embed_name: str = "embed.weight"
    skipped: tuple = field(default=())

    def model_name(self, key):
        return key

    def as_in_file(self, names, file_names):
        return list(names)

    def prepare(self, cfg, tensors):
        return None

    def expected_shapes(self, model, cfg, names):
        return {n: tuple(t.shape) for n, t in model.state_dict().items()}

    def mismatch_note(self, raw, tensors, cfg):
        return ""

    def to_model_layout(self, tensors, cfg):
        return dict(tensors)

    def keep_fp32(self, name):
        return False


def write_toy_checkpoint(directory: Path) -> Path:
    raw = {"model_type": TOY_TYPE, "vocab_size": 64, "hidden_size": 16}
    model = ToyModel(toy_config(raw))
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, p in model.state_dict().items():
        if name.endswith("A_log"):
            tensors[name] = torch.empty(p.shape).uniform_(0.5, 3.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            tensors[name] = torch.empty(p.shape).uniform_(-3.0, 1.0, generator=gen)
        elif name.endswith("norm.weight"):
            tensors[name] = torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen)
        else:
            tensors[name] = torch.randn(p.shape, generator=gen)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw))
    save_file(tensors, directory / "model.safetensors")
    return directory


TOY = ModelFamily(
    name="toy", model_types=(TOY_TYPE,), config_from_dict=toy_config, model_class=ToyModel,
    weights=ToyWeights(),
    cache_specs=lambda cfg, k, drafter_kv: {"scan": Mamba2Mixer.cache_spec(cfg, k),
                                            "attn": Attention.cache_spec(cfg, k)},
    tiny_checkpoints=(("toy", write_toy_checkpoint),),
)


def test_a_family_registered_outside_refengine_runs_on_both_engines(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "FAMILIES", (*registry.FAMILIES, TOY))
    path = write_toy_checkpoint(tmp_path / "toy")
    prompts = [[5, 9, 13], list(range(1, 30)), [7]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = {engine: [o.token_ids for o in LLM(model=str(path), engine=engine, max_num_batched_tokens=16)
                     .generate(prompts, params)] for engine in ("reference", "async")}
    assert outs["reference"] == outs["async"]
    # The engines' incremental runs equal a full recompute of every sequence from scratch.
    net, cfg = load_model(path)
    for prompt, got in zip(prompts, outs["reference"]):
        seq = list(prompt)
        for _ in range(6):
            tokens, _, _ = greedy_generate(net, cfg, [seq], 1)
            seq.append(tokens[0][0])
        assert got == seq[len(prompt):]


def test_an_unknown_model_type_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    expected = r"model_type: unsupported 'gpt2', expected one of .*llama.*nemotron_h.*qwen3"
    with pytest.raises(CheckpointError, match=expected):
        load_model(tmp_path)


# ---- a family is one package plus one line -------------------------------------------------------------
MODEL = ROOT / "model"


def family_packages() -> list[str]:
    """The packages of refengine/model/ that define a family (export ``FAMILY``; ``eagle/`` holds draft
    heads, no family)."""
    return sorted(p.parent.name for p in MODEL.glob("*/__init__.py") if "FAMILY" in p.read_text())


def registry_lines() -> list[str]:
    """The entries of registry.py's ``FAMILIES`` as written (``<package>.FAMILY`` each)."""
    for node in ast.parse((MODEL / "registry.py").read_text()).body:
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "FAMILIES":
            return [ast.unparse(e) for e in node.value.elts]
    raise AssertionError("registry.py has no FAMILIES tuple")


def family_imports(path: Path) -> list[str]:
    """The family packages a module imports at run time (an ``if TYPE_CHECKING:`` import does not run)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
    packages, found = set(family_packages()), []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [n for n in names if n.split(".")[:2] == ["refengine", "model"] and len(n.split(".")) > 2
                  and n.split(".")[2] in packages]
    return found


def test_every_family_package_is_one_line_of_the_registry():
    assert family_packages() == ["llama", "nemotron_h", "qwen3_next"]
    assert sorted(registry_lines()) == [f"{p}.FAMILY" for p in family_packages()]
    assert [f.name for f in registry.FAMILIES] == [line.split(".")[0] for line in registry_lines()]


def test_the_shared_model_modules_import_no_family():
    """refengine/model/*.py is what every family shares; only the registry names the families."""
    found = {p.name: v for p in sorted(MODEL.glob("*.py"))
             if p.name != "registry.py" and (v := family_imports(p))}
    assert found == {}


def test_the_package_scan_finds_a_family_import(tmp_path):
    shared = tmp_path / "shared.py"
    shared.write_text("from typing import TYPE_CHECKING\n"
                      "from refengine.model.qwen3_next.config import FULL\n"
                      "if TYPE_CHECKING:\n    from refengine.model.nemotron_h import NemotronHConfig\n")
    assert family_imports(shared) == ["refengine.model.qwen3_next.config",
                                      "refengine.model.qwen3_next.config.FULL"]


def test_every_registry_field_is_read_outside_the_families():
    """Each ModelFamily field is read (``<family>.<field>``) by a module that is not a family's own."""
    sources = [p for d in (ROOT, ROOT.parent / "conformance", ROOT.parent / "tests" / "helpers")
               for p in d.rglob("*.py") if p.parent == MODEL or MODEL not in p.parents]
    read = {node.attr for p in sources for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)}
    fields = {f.name for f in dataclasses.fields(ModelFamily)}
    assert fields - read == set()


def test_a_new_family_brings_its_tiny_model(tmp_path, monkeypatch):
    """With its one line in FAMILIES, ``tiny:toy`` exists: the family's own writer, the tokenizer added."""
    from refengine.tools import tiny_models

    assert "tiny:toy" not in tiny_models.tiny_names()
    monkeypatch.setattr(registry, "FAMILIES", (*registry.FAMILIES, TOY))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert "tiny:toy" in tiny_models.tiny_names()
    path = Path(tiny_models.tiny_model_path("tiny:toy"))
    assert path.parent == tmp_path and (path / "tokenizer.json").is_file()
    assert load_model(path)[1].model_type == TOY_TYPE
