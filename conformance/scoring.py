"""The reference engine's model scores an engine's output: one teacher-forced prefill per request.

For a request with prompt ``P`` and output ``o_0 .. o_{n-1}`` the reference model (refengine's, in the
reference dtype, on the reference device) runs one prefill over ``P + o_0 .. o_{n-2}`` from zero state, and
the logits at the position before each output token are what the reference would have picked from, given
the engine's own tokens before it. Each row is processed as the engines process it: the request's grammar
mask (structured outputs), then its logits processors (``refengine.logits_process``: allowed ids, bias,
``min_tokens``, penalties, bad words) over the tokens before it. A position's **margin** is
``max(processed) - processed[o_i]`` in nats (log-softmax terms: the normaliser cancels): 0 when the engine's
token is the reference's argmax, infinite when the request's parameters forbid it.

A request that samples (a temperature) is not scored: its tokens are a draw, equal to the reference's in
distribution only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SAMPLED = "it samples (a temperature): its tokens are draws, judged in distribution only"


@dataclass
class RequestScore:
    """The reference's view of one request's output (JSON-ready)."""

    request_id: str
    tokens: list[int]  # the output judged, as the engine returned it
    argmax: list[int] = field(default_factory=list)  # per position: the reference's pick there
    margins: list[float] = field(default_factory=list)  # per position: nats below the reference's pick
    logprobs: list[float] = field(default_factory=list)  # per position: the token's, after the processors
    skipped: str | None = None  # why it was not scored (its positions are then empty)

    def divergences(self) -> list[int]:
        """The positions whose token is not the reference's pick."""
        return [i for i, (t, a) in enumerate(zip(self.tokens, self.argmax)) if t != a]

    def worst(self) -> int | None:
        """The position of the largest margin (None: nothing scored)."""
        if not self.margins:
            return None
        return max(range(len(self.margins)), key=lambda i: (self.margins[i], -i))


class Scorer:
    """The reference model of one checkpoint in one dtype on one device, loaded once."""

    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu", chunked: bool = False):
        """``chunked``: the recurrent mixers' prefill runs their chunked kernels, not the recurrent form the
        engines use (a kernel-shape control, ``conformance calibrate``)."""
        from refengine.config import DTYPES
        from refengine.model.loader import load_model
        from refengine.tokenizer import load_tokenizer

        self.dtype, self.device, self.chunked = dtype, device, chunked
        self.net, self.cfg = load_model(model_path, dtype=DTYPES[dtype], device=device)
        self.tokenizer = load_tokenizer(model_path)
        self._grammars = None  # built on the first request with structured outputs

    def logits(self, ids: list[int], start: int = 0):
        """[len(ids) - start, V] float32: the logits after each token of ``ids`` from index ``start`` on, one
        prefill from zero state."""
        import torch

        from refengine.forward_context import AttnMetadata, ForwardContext, RecurrentGroup, RecurrentMetadata
        from refengine.model.cache_specs import PagedKV
        from refengine.model.registry import cache_specs

        n, block = len(ids), 16
        blocks = -(-n // block)
        dtype = next(self.net.parameters()).dtype
        kv, states = {}, {}
        for key, spec in cache_specs(self.cfg, 0, drafter_kv=False).items():
            if isinstance(spec, PagedKV):
                kv[key] = spec.allocate(blocks + 1, block, dtype, self.device)
            else:
                states[key] = spec.allocate(1, dtype, self.device)
        dev = self.device

        def i32(values):
            return torch.tensor(values, dtype=torch.int32, device=dev)

        attn = AttnMetadata(query_start_loc=i32([0, n]), seq_lens=i32([n]),
                            block_table=i32([list(range(blocks))]),
                            slot_mapping=torch.arange(n, dtype=torch.int64, device=dev))
        group = RecurrentGroup(token_indices=torch.arange(n, dtype=torch.int64, device=dev),
                               query_start_loc=i32([0, n]), state_indices=i32([0]),
                               has_initial_state=torch.zeros(1, dtype=torch.bool, device=dev))
        ctx = ForwardContext(attn=attn, recurrent=RecurrentMetadata(prefill=group), kv_caches=kv,
                             states=states, recurrent_prefill_chunked=self.chunked)
        with torch.inference_mode():
            tokens = torch.tensor(ids, dtype=torch.int64, device=dev)
            hidden = self.net(tokens, torch.arange(n, dtype=torch.int64, device=dev), ctx)  # [n, H]
            return self.net.compute_logits(hidden[start:]).to(torch.float32)  # [n - start, V]

    def score(self, request_id: str, prompt: list[int], output: list[int], params: dict | None = None,
              max_tokens: int | None = None, stop_token_ids=(), ignore_eos: bool = True) -> RequestScore:
        """The margins of ``output`` after ``prompt`` under the request's parameters (``params``: its
        SamplingParams fields, vLLM's names)."""
        import torch

        params = dict(params or {})
        out = RequestScore(request_id, list(output))
        if params.get("temperature", 0.0) >= 1e-5:
            out.skipped = SAMPLED
            return out
        if not output:
            return out
        logits = self.logits([*prompt, *output[:-1]], len(prompt) - 1)  # [n, V]: row i picks output[i]
        processors, grammar = self._processors(params, max_tokens or len(output), stop_token_ids, ignore_eos)
        if processors is None and grammar is None:
            rows = logits
        else:
            rows = torch.stack([self._processed(logits[i], processors, grammar, prompt, output[:i])
                                for i in range(len(output))])
        best = rows.max(dim=-1)
        picked = torch.tensor(output, device=rows.device).unsqueeze(1)  # [n, 1]
        chosen = rows.gather(1, picked).squeeze(1)  # [n]
        out.argmax = rows.argmax(dim=-1).tolist()
        logprobs = torch.log_softmax(rows, dim=-1).gather(1, picked).squeeze(1)  # [n]
        out.logprobs = [float(v) for v in logprobs.tolist()]
        out.margins = [math.inf if not math.isfinite(c) else float(b - c)
                       for b, c in zip(best.values.tolist(), chosen.tolist())]
        return out

    def _processors(self, params: dict, max_tokens: int, stop_token_ids, ignore_eos: bool):
        """(Processors or None, GrammarState or None) of a request's parameters."""
        from refengine.logits_process import resolve
        from refengine.sampling_params import SamplingParams

        if not params:
            return None, None
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=list(stop_token_ids),
                            **params)
        processors = resolve(sp, self.cfg.vocab_size, self.cfg.eos_token_ids, self.tokenizer)
        grammar = None
        if sp.structured_outputs is not None:
            from refengine.grammar import GrammarCompiler

            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.cfg.vocab_size, self.cfg.eos_token_ids)
            grammar = self._grammars.state(self._grammars.compile(sp.structured_outputs))
        return (processors if processors.active else None), grammar

    @staticmethod
    def _processed(row, processors, grammar, prompt: list[int], before: list[int]):
        """One position's logits [V] as the engines pick from them: the grammar's mask, then the processors
        (the grammar is advanced by the token before this position)."""
        from refengine.grammar import apply_bitmask
        from refengine.logits_process import process

        if grammar is not None:
            if before:
                grammar.accept(before[-1])
            row = apply_bitmask(row.unsqueeze(0), grammar.window_bitmask([]).to(row.device)).squeeze(0)
        return process(row, processors, prompt, before) if processors is not None else row


def score_trace(scorer: Scorer, trace, scenario) -> dict[str, RequestScore]:
    """Every request of the engine's ``trace`` that came back, scored by ``scorer`` (the scenario's request
    specs give the parameters); by request id."""
    specs = {r.request_id: r for r in scenario.requests}
    out = {}
    for rid, req in sorted(trace.requests.items()):
        spec = specs.get(rid)
        if spec is None:
            continue
        out[rid] = scorer.score(rid, req.prompt_token_ids, req.token_ids, spec.sampling, spec.max_tokens,
                                spec.stop_token_ids, spec.ignore_eos)
    return out


def score_runs(scenario, case, traces: dict) -> dict[str, dict[str, RequestScore]]:
    """The reference's scoring (``case``'s reference dtype and device) of the engine under test's runs
    that finished: "test", and "test-plain" (its K=0 run) when there is one."""
    runs = {k: t for k, t in traces.items() if k in ("test", "test-plain") and t.error is None}
    if not runs:
        return {}
    scorer = Scorer(case.facts.path, case.judged.reference_dtype, case.reference_device or case.device)
    return {k: score_trace(scorer, t, scenario) for k, t in runs.items()}
