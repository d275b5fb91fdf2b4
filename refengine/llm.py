"""The public entry point: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from refengine.async_engine import AsyncEngine
from refengine.config import (
    DTYPES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    check_bool,
    speculative_from_vllm,
)
from refengine.core import EngineError, Occupancy
from refengine.drafters import ScriptedDrafter
from refengine.model.loader import load_model, read_config_file, resolve_dtype, resolve_model_path
from refengine.outputs import RequestOutput, StepRecord
from refengine.reference import ReferenceEngine
from refengine.request import Request
from refengine.sampling import seed_torch
from refengine.sampling_params import SamplingParams
from refengine.tokenizer import load_tokenizer


class LLM:
    def __init__(self, model: str | None = None, engine: str = "reference", num_speculative_tokens: int = 0,
                 drafter="mtp", prompt_lookup_min: int | None = None, prompt_lookup_max: int | None = None,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 256,
                 block_size: int = 16, num_kv_blocks: int | None = None, dtype: str = "float32",
                 device: str = "cpu", seed: int = 0, max_model_len: int | None = None,
                 graph_mode: str = "none", recurrent_prefill_chunked: bool = False,
                 enable_prefix_caching: bool = False, mamba_cache_mode: str | None = None,
                 num_state_checkpoints: int | None = None,
                 observer: Callable[[StepRecord], None] | None = None, delay_copies: bool = False,
                 hazard_check: bool = False, allow_non_finite_weights: bool = False,
                 draft_model: str | None = None, speculative_config: dict | None = None):
        """Every setting is checked before anything is loaded: a bad one raises ``ConfigError``
        naming it. ``dtype="auto"`` takes the checkpoint's dtype. ``allow_non_finite_weights`` loads
        a checkpoint holding NaN/Inf (debugging only). ``draft_model``: the drafter's checkpoint
        (``drafter="draft_model"``). ``speculative_config``: vLLM's dict form (``{"method": "draft_model",
        "model": PATH, "num_speculative_tokens": K}``), instead of the drafter arguments."""
        if speculative_config is not None:
            given = [n for n, v, d in (("num_speculative_tokens", num_speculative_tokens, 0),
                                       ("drafter", drafter, "mtp"), ("draft_model", draft_model, None),
                                       ("prompt_lookup_min", prompt_lookup_min, None),
                                       ("prompt_lookup_max", prompt_lookup_max, None)) if v != d]
            if given:
                raise ConfigError(f"speculative_config and {', '.join(given)} both given: pass one form")
            spec_args = speculative_from_vllm(speculative_config)
            num_speculative_tokens = spec_args.pop("num_speculative_tokens")
            drafter = spec_args.pop("drafter")
            draft_model = spec_args.pop("draft_model", None)
            prompt_lookup_min = spec_args.pop("prompt_lookup_min", None)
            prompt_lookup_max = spec_args.pop("prompt_lookup_max", None)
        if observer is not None and not callable(observer):
            raise ConfigError(f"observer must be callable or None, got {observer!r}")
        for name, value in (("delay_copies", delay_copies), ("hazard_check", hazard_check),
                            ("allow_non_finite_weights", allow_non_finite_weights)):
            check_bool(name, value)
        if model is not None and not isinstance(model, str | os.PathLike):
            raise ConfigError(f"model must be a checkpoint folder path or None, got {model!r}")
        path = resolve_model_path(model) if model is not None else default_model_path()
        if isinstance(draft_model, str | os.PathLike) and drafter not in ("eagle", "eagle3"):
            draft_model = resolve_model_path(draft_model, "draft_model")  # an EAGLE head: a folder, as it is
        config_file = read_config_file(Path(path))  # read once: the model is built from it below
        positions = config_file.view.max_position_embeddings
        if dtype == "auto":
            dtype = resolve_dtype(dtype, path)  # the checkpoint's own dtype
        self.config = EngineConfig(
            model=path,
            engine=engine,
            dtype=dtype,
            device=device,
            seed=seed,
            graph_mode=graph_mode,
            recurrent_prefill_chunked=recurrent_prefill_chunked,
            cache=CacheConfig(
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                enable_prefix_caching=enable_prefix_caching,
                mamba_cache_mode=mamba_cache_mode,
                num_state_checkpoints=num_state_checkpoints,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=min(positions, 1024) if max_model_len is None else max_model_len,
            ),
            speculative=SpeculativeConfig(
                num_speculative_tokens=num_speculative_tokens,
                drafter=drafter,
                prompt_lookup_min=prompt_lookup_min,
                prompt_lookup_max=prompt_lookup_max,
                draft_model=draft_model,
            ),
        )
        if self.config.scheduler.max_model_len > positions:
            raise ConfigError(f"max_model_len={max_model_len!r} exceeds the model's max_position_embeddings "
                              f"({positions})")
        seed_torch(seed)
        net, model_config = load_model(path, dtype=DTYPES[self.config.dtype], device=self.config.device,
                                       allow_non_finite=allow_non_finite_weights, config=config_file)
        self.tokenizer = load_tokenizer(path)
        spec = self.config.speculative
        if isinstance(spec.drafter, ScriptedDrafter) and spec.drafter.truth is None:
            spec.drafter.truth = GreedyTruth(self.config, net, model_config, self.tokenizer)
        elif spec.drafter == "scripted" and spec.enabled:
            spec.drafter = ScriptedDrafter(num_speculative_tokens, model_config.vocab_size,
                                           truth=GreedyTruth(self.config, net, model_config, self.tokenizer))
        async_options = {"delay": delay_copies, "hazard_check": hazard_check} if engine == "async" else {}
        self.engine = _make_engine(self.config, net, model_config, self.tokenizer, **async_options)
        if observer is not None:
            self.engine.add_observer(observer)
        self._next_id = 0

    @property
    def model_config(self):
        return self.engine.model_config

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise EngineError("text prompts need a tokenizer; this checkpoint has none (pass token ids)")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        All prompts are validated before any is added, so a bad one refuses the whole call and
        leaves the engine as it was.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        _check_params(params)
        if len(params) != len(prompts):
            raise EngineError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        batch = []
        for prompt, p in zip(prompts, params):
            rid = f"gen-{self._next_id + len(batch)}"
            batch.append((rid, self.engine.validate(rid, self._tokenize(prompt), p), p))
        self._next_id += len(batch)
        for rid, ids, p in batch:
            self._add(rid, ids, p)
        wanted = {rid for rid, _, _ in batch}
        done: dict[str, RequestOutput] = {}
        while wanted - done.keys():
            for out in self.engine.step():
                done[out.request_id] = out
        return [done[rid] for rid, _, _ in batch]

    # Lower-level API.
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        self._add(request_id, self._tokenize(prompt), params or SamplingParams())

    def _add(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        req = self.engine.add_request(request_id, ids, params)
        expect = getattr(getattr(self.config.speculative.drafter, "truth", None), "expect", None)
        if req is not None and callable(expect):
            expect(req)  # a scripted drafter's truth source runs the requests it will be asked for together

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def abort(self, request_id: str) -> RequestOutput | None:
        """Output of the aborted request (finish reason ``abort``); None when it had already finished
        and its output comes with the next ``step()``."""
        return self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def occupancy(self) -> Occupancy:
        """The engine's pools, used and free: KV blocks, state slots, request slots (async engine),
        and its waiting / running request counts. ``.empty`` once everything finished."""
        return self.engine.occupancy()


def _check_params(params) -> None:
    """``generate``'s params: SamplingParams or a sequence of them (each checked by the engine). A dict
    such as ``{"max_tokens": 4}`` would otherwise be read as the sequence of its keys."""
    if isinstance(params, str | bytes) or not isinstance(params, Sequence):
        raise EngineError(
            f"params must be a SamplingParams or a list of them, got {type(params).__name__} "
            f"{params!r}" + (" (pass SamplingParams(**it))" if isinstance(params, dict) else "")
        )


def _make_engine(config: EngineConfig, net, model_config, tokenizer, **async_options):
    if config.engine == "reference":
        return ReferenceEngine(config, net, model_config, tokenizer)
    return AsyncEngine(config, net, model_config, tokenizer, **async_options)


class GreedyTruth:
    """A scripted drafter's truth source: each request's plain greedy (K=0) output under its own logits
    processors, from a private reference engine on the same weights, ``K`` tokens past ``max_tokens`` so
    drafts made near the end are scripted too (stop strings and logprobs left out: they change no token; a
    sampled request's truth is its greedy continuation, what the drafts of a greedy drafter are)."""

    def __init__(self, config: EngineConfig, net, model_config, tokenizer=None):
        # The requests added since the last run whose truth is not known yet: the next truth asked for
        # runs them all at once (the reference engine is batch-invariant, so each gets what it would alone).
        self._expected: list[Request] = []
        self._config = EngineConfig(
            model=config.model,
            engine="reference",
            dtype=config.dtype,
            device=config.device,
            seed=config.seed,
            recurrent_prefill_chunked=config.recurrent_prefill_chunked,
            scheduler=config.scheduler,
            cache=CacheConfig(block_size=config.cache.block_size),
        )
        self._num_speculative_tokens = config.speculative.num_speculative_tokens
        self._net, self._model_config, self._tokenizer = net, model_config, tokenizer
        self._engine: ReferenceEngine | None = None
        # (prompt ids, repr of the params) -> truth: a request admitted again (after a preemption) or asked
        # for by both proposers is not run again; its greedy output is a function of these alone.
        self._known: dict[tuple[tuple[int, ...], str], list[int]] = {}

    @staticmethod
    def _key(req: Request) -> tuple[tuple[int, ...], str]:
        return tuple(req.prompt_token_ids), repr(req.params)

    def expect(self, req: Request) -> None:
        """``req`` was added to the engine: its truth will be asked for."""
        if self._key(req) not in self._known:
            self._expected.append(req)

    def __call__(self, req: Request) -> list[int]:
        if self._key(req) not in self._known:
            self._run([req, *(r for r in self._expected if r is not req)])
        return list(self._known[self._key(req)])

    def _run(self, reqs: list[Request]) -> None:
        """Run every request of ``reqs`` whose truth is not known (each distinct one once), together."""
        if self._engine is None:
            self._engine = ReferenceEngine(self._config, self._net, self._model_config, self._tokenizer)
        todo = {}
        for req in reqs:
            todo.setdefault(self._key(req), req)
        todo = {k: r for k, r in todo.items() if k not in self._known}
        self._expected = []
        for i, req in enumerate(todo.values()):
            p = req.params
            self._engine.add_request(
                f"truth-{i}",
                req.prompt_token_ids,
                dataclasses.replace(p, max_tokens=p.max_tokens + self._num_speculative_tokens, stop=None,
                                    include_stop_str_in_output=False, logprobs=None, prompt_logprobs=None,
                                    temperature=0.0),
            )
        outputs = {}
        while self._engine.has_unfinished():
            outputs.update((out.request_id, out.token_ids) for out in self._engine.step())
        for i, k in enumerate(todo):
            self._known[k] = outputs[f"truth-{i}"]


def default_model_path() -> str:
    from importlib.resources import files

    path = files("refengine") / "data" / "default_model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            "the embedded default model is not installed; pass model=PATH to a checkpoint"
        )
    return str(path)
