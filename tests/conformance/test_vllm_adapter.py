"""The vLLM adapter without vLLM: its settings mapping, its refusals, its reading of vLLM's outputs and of
the installed vLLM's speculative methods (a stub ``vllm`` package stands in for the real one; tests/vllm
runs the real one)."""

from __future__ import annotations

import json
import sys
import types
import typing
from dataclasses import dataclass, field

import pytest

from conformance.adapters import vllm as adapter
from conformance.api import RunSpec, UnknownEngine
from conformance.workloads.scenario import EngineSettings


def _spec(tmp_path, **settings) -> RunSpec:
    return RunSpec(str(tmp_path), EngineSettings(**settings), 256, lambda rec: None)


def test_engine_args_map_the_suite_settings_to_vllm_names(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NemotronHForCausalLM"]}))
    ngram = adapter.engine_args(_spec(
        tmp_path, num_speculative_tokens=3, drafter="ngram", prompt_lookup_min=1, prompt_lookup_max=3,
        max_num_batched_tokens=4, num_kv_blocks=12, enable_prefix_caching=True, mamba_cache_mode="align"))
    assert ngram["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                           "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert ngram["per_request_spec_decode_metrics"] == "detailed"
    assert ngram["enable_prefix_caching"] and ngram["mamba_cache_mode"] == "align"
    # the chunk budget never below max_num_seqs (vLLM's rule); 12 blocks of 16 tokens in 32-token blocks
    assert ngram["max_num_batched_tokens"] == 8 and ngram["enable_chunked_prefill"]
    assert ngram["num_gpu_blocks_override"] == 12 * 16 // 32 + 1
    assert ngram["enforce_eager"] and ngram["disable_log_stats"] is False
    plain = adapter.engine_args(_spec(tmp_path))
    assert "speculative_config" not in plain and not plain["enable_prefix_caching"]
    assert "mamba_cache_mode" not in plain and "num_gpu_blocks_override" not in plain
    mtp = adapter.speculative_config(_spec(tmp_path, num_speculative_tokens=2, drafter="mtp"))
    assert mtp == {"method": "mtp", "num_speculative_tokens": 2}
    graphs = adapter.engine_args(_spec(tmp_path), graph_mode="full_and_piecewise")
    assert graphs["compilation_config"] == {"cudagraph_mode": "FULL_AND_PIECEWISE"}
    assert not graphs["enforce_eager"]


@pytest.mark.parametrize("config,dtype,problem", [
    ({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16},
     "float32", "attention head size 16"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "num_attention_heads": 4}, "float32", None),
    ({"architectures": ["Qwen3NextForCausalLM"], "head_dim": 64, "linear_key_head_dim": 32,
      "linear_value_head_dim": 32, "num_experts": 4}, "bfloat16", "GDN key/value head sizes 32/32"),
    ({"architectures": ["Qwen3NextForCausalLM"], "head_dim": 64, "linear_key_head_dim": 64,
      "linear_value_head_dim": 64, "num_experts": 4}, "float32", "bfloat16 only"),
    ({"architectures": ["Qwen3NextForCausalLM"], "head_dim": 64, "linear_key_head_dim": 64,
      "linear_value_head_dim": 64, "num_experts": 0}, "bfloat16", "needs at least one MoE layer"),
    ({"architectures": ["NemotronHForCausalLM"], "head_dim": 32, "mlp_hidden_act": "relu2",
      "layers_block_type": ["mamba", "moe"]}, "float32", "non-gated (relu2) MoE"),
    ({"architectures": ["NemotronHForCausalLM"], "head_dim": 32, "layers_block_type": ["mamba", "mlp"]},
     "float32", "lm_head.weight"),
])
def test_checkpoints_vllm_cannot_load_are_refused_in_one_line(tmp_path, config, dtype, problem):
    (tmp_path / "config.json").write_text(json.dumps(config))
    got = adapter.cpu_constraint(str(tmp_path), dtype)
    assert (got is None) if problem is None else (problem in got and "\n" not in got)


def test_without_vllm_the_engine_name_says_how_to_install(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(UnknownEngine, match="vLLM is not installed here.*ci/install_vllm.py"):
        adapter.VllmAdapter()


def _stub_vllm(monkeypatch, methods: tuple[str, ...]) -> None:
    """A ``vllm.config.speculative`` whose SpeculativeMethod nests Literals as vLLM's does."""
    inner = typing.Literal[methods[1:]] if len(methods) > 1 else typing.Literal[methods[0]]
    spec = types.ModuleType("vllm.config.speculative")
    spec.SpeculativeMethod = typing.Literal[methods[0]] | inner
    config = types.ModuleType("vllm.config")
    config.speculative = spec
    root = types.ModuleType("vllm")
    root.config = config
    for name, mod in (("vllm", root), ("vllm.config", config), ("vllm.config.speculative", spec)):
        monkeypatch.setitem(sys.modules, name, mod)


def test_features_are_read_from_the_installed_vllm(monkeypatch):
    from importlib import metadata

    monkeypatch.setattr(metadata, "version", lambda name: "0.0-stub")
    _stub_vllm(monkeypatch, ("ngram", "draft_model", "eagle3"))
    a = adapter.VllmAdapter()
    assert a.supports("ngram_drafter") and a.supports("draft_model") and a.supports("eagle_drafter")
    assert not a.supports("mtp")  # this stub's vLLM has no "mtp" method
    assert a.supports("prefix_caching")
    for feature in ("step_records", "batch_invariant", "pools", "scripted_drafter"):
        assert not a.supports(feature)


@dataclass
class _Logprob:
    logprob: float


@dataclass
class _Completion:
    token_ids: list
    finish_reason: str
    stop_reason: object
    text: str = "ab"
    logprobs: list | None = None
    spec_decode_metrics: object = None


@dataclass
class _Metrics:
    per_step_drafted: list = field(default_factory=list)
    per_step_accepted: list = field(default_factory=list)


@dataclass
class _Output:
    request_id: str
    outputs: list
    prompt_token_ids: list = field(default_factory=lambda: [5, 6])
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None
    finished: bool = True


def _instance(eos_ids=frozenset({2})):
    inst = object.__new__(adapter.VllmInstance)
    inst._eos_ids, inst._tokenizer = set(eos_ids), object()
    return inst


def test_outputs_read_as_the_reference_reports_them():
    inst = _instance()
    eos = inst._output(_Output("a", [_Completion([7, 2], "stop", 2)]))
    assert eos.stop_reason is None and eos.finish_reason == "stop"  # an EOS stop, as the reference says it
    stop_id = inst._output(_Output("b", [_Completion([7, 9], "stop", 9)]))
    assert stop_id.stop_reason == 9  # a request's own stop id stays
    spec = inst._output(_Output("c", [_Completion([7, 8, 9], "length", None, logprobs=[{7: _Logprob(-0.5)}],
                                                  spec_decode_metrics=_Metrics([3, 3], [2, 0]))]))
    assert spec.acceptance == [(3, 2), (3, 0)]
    assert (spec.num_draft_tokens, spec.num_accepted_tokens) == (6, 2)
    assert spec.logprobs == [{7: -0.5}] and spec.prompt_token_ids == [5, 6]


def test_scenarios_vllm_cannot_run_are_named():
    from conformance.workloads import get_def

    a = object.__new__(adapter.VllmAdapter)
    sampled = get_def("sampling-preemption-k0").materialize("default", 256)
    assert "draws its own sampling noise" in a.refuses(sampled)
    assert a.refuses(get_def("short-prompts-k0").materialize("default", 256)) is None
    scripted = get_def("scripted-ragged-k3").materialize("default", 256)
    assert "scripted drafter" in a.refuses(scripted)


def test_cudagraph_modes_are_engine_names(monkeypatch):
    from importlib import metadata

    from conformance.adapters import load_engine

    monkeypatch.setattr(metadata, "version", lambda name: "0.0-stub")
    full = load_engine("vllm:full_and_piecewise")
    assert full.name == "vllm:full_and_piecewise" and full.graph_mode == "full_and_piecewise"
    with pytest.raises(UnknownEngine, match="unknown vLLM cudagraph mode 'fast'"):
        load_engine("vllm:fast")


def test_a_mamba_cache_mode_the_installed_vllm_lacks_is_a_named_skip(monkeypatch, tmp_path):
    """vLLM 0.32's CacheConfig takes mamba_cache_mode 'align' or 'none': a hybrid's 'all' scenario is skipped
    with that reason (read from vLLM's MambaCacheMode), not run into vLLM's validation error."""
    from dataclasses import replace

    from conformance.workloads import get_def

    cache = types.ModuleType("vllm.config.cache")
    cache.MambaCacheMode = typing.Literal["align", "none"]
    monkeypatch.setitem(sys.modules, "vllm.config.cache", cache)
    a = object.__new__(adapter.VllmAdapter)
    a.version = "0.0-stub"
    hybrid, dense = tmp_path / "h", tmp_path / "d"
    for folder, arch in ((hybrid, "NemotronHForCausalLM"), (dense, "LlamaForCausalLM")):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"architectures": [arch]}))
    sc = get_def("prefix-system-prompt-k0").materialize("default", 256)
    all_mode = replace(sc, settings=replace(sc.settings, enable_prefix_caching=True, mamba_cache_mode="all"))
    assert a.refuses(all_mode, str(hybrid)) == ("vLLM 0.0-stub's mamba_cache_mode takes 'align' or 'none', "
                                                "not 'all' (CacheConfig)")
    assert a.refuses(all_mode, str(dense)) is None  # a dense model has no Mamba cache to configure
    align = replace(sc, settings=replace(sc.settings, enable_prefix_caching=True, mamba_cache_mode="align"))
    assert a.refuses(align, str(hybrid)) is None


def test_kv_pressure_on_a_hybrid_is_a_named_skip(monkeypatch, tmp_path):
    from conformance.workloads import get_def

    cache = types.ModuleType("vllm.config.cache")
    cache.MambaCacheMode = typing.Literal["align", "none"]
    monkeypatch.setitem(sys.modules, "vllm.config.cache", cache)
    a = object.__new__(adapter.VllmAdapter)
    a.version = "0.0-stub"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NemotronHForCausalLM"]}))
    pressure = get_def("preemption-k0").materialize("default", 256)
    assert pressure.settings.num_kv_blocks is not None
    assert "KV pressure" in a.refuses(pressure, str(tmp_path))
    roomy = get_def("prefix-multi-turn-k1").materialize("default", 256)  # 256 blocks of 4: no pressure
    assert roomy.settings.num_kv_blocks is not None and a.refuses(roomy, str(tmp_path)) is None
    assert a.refuses(pressure, None) is None  # a dense model (no config to read): vLLM takes the override
