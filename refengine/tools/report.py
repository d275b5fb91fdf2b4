"""Speculative-decoding figures for a model on the default workload (the embedded model by default).

    python -m refengine.tools.report [--model PATH] [--num-spec-tokens 3] [--max-tokens 64] [--samples N]
                                     [--dtype float32|bfloat16|float16|auto]

Prints the acceptance length (1 + accepted drafts per verify step), the acceptance rate of each
draft position, the histogram of accepted counts 0..K, tokens/s with K=0 and with K drafts, whether
both runs produced the same tokens (greedy speculation is lossless), and sample continuations.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from refengine.tools.default_workload import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_NUM_SPEC_TOKENS,
    DEFAULT_PROMPTS,
    default_params,
)
from refengine.tools.errors import OneLineParser, add_dtype_flag, int_at_least

if TYPE_CHECKING:  # torch loads when the command runs, not when its parser answers --help
    from refengine.outputs import RequestOutput


@dataclass
class AcceptanceStats:
    num_speculative_tokens: int
    verify_steps: int
    accepted: int
    histogram: list[int]  # [K+1]: verify steps that accepted 0..K drafts
    position_rates: list[float]  # [K]: P(draft j accepted | draft j proposed), j = 1..K

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else 1.0


def acceptance_stats(outputs: list[RequestOutput], k: int) -> AcceptanceStats:
    """Per-step (drafted, accepted) pairs of every output, summarised."""
    histogram = [0] * (k + 1)
    proposed, kept = [0] * k, [0] * k
    steps = accepted = 0
    for out in outputs:
        for drafted, acc in out.acceptance:
            steps += 1
            accepted += acc
            histogram[acc] += 1
            for j in range(drafted):
                proposed[j] += 1
                kept[j] += j < acc
    rates = [kept[j] / proposed[j] if proposed[j] else 0.0 for j in range(k)]
    return AcceptanceStats(k, steps, accepted, histogram, rates)


@dataclass
class RunResult:
    outputs: list[RequestOutput]
    seconds: float
    dtype: str = "float32"  # what the engine ran in ("auto" resolved to the checkpoint's dtype)

    @property
    def num_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("inf")


def run_workload(
    model: str | None = None,
    num_speculative_tokens: int = 0,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    prompts: list[str] | None = None,
    device: str = "cpu",
    dtype: str = "float32",
) -> RunResult:
    """Generate the workload (all prompts in one batch) with K = ``num_speculative_tokens`` MTP drafts."""
    from refengine.llm import LLM
    from refengine.tools.tiny_models import resolve_tiny

    prompts = [p.text for p in DEFAULT_PROMPTS] if prompts is None else prompts
    llm = LLM(model=resolve_tiny(model), num_speculative_tokens=num_speculative_tokens,
              max_num_seqs=max(len(prompts), 1), device=device, dtype=dtype)
    start = time.perf_counter()
    outputs = llm.generate(prompts, default_params(max_tokens))
    return RunResult(outputs, time.perf_counter() - start, llm.config.dtype)


def format_report(plain: RunResult, spec: RunResult, stats: AcceptanceStats, samples: int) -> str:
    k = stats.num_speculative_tokens
    speedup = spec.tokens_per_s / plain.tokens_per_s
    identical = all(a.token_ids == b.token_ids for a, b in zip(plain.outputs, spec.outputs))
    lines = [
        (f"workload: {len(plain.outputs)} text prompts, {plain.num_tokens} generated tokens (greedy), "
         f"dtype {plain.dtype}"),
        f"K={k} MTP drafts: {stats.verify_steps} verify steps, {stats.accepted} drafts accepted",
        f"acceptance length: {stats.acceptance_length:.3f}",
        "per-position acceptance: "
        + ", ".join(f"pos {j + 1}: {r:.3f}" for j, r in enumerate(stats.position_rates)),
        "accepted-count histogram: " + ", ".join(f"{n}: {c}" for n, c in enumerate(stats.histogram)),
        f"tokens/s: K=0 {plain.tokens_per_s:.1f}, K={k} {spec.tokens_per_s:.1f} (speedup {speedup:.2f}x)",
        f"K=0 and K={k} tokens identical: {identical}",
    ]
    for prompt, out in list(zip(DEFAULT_PROMPTS, plain.outputs))[:samples]:
        lines.append(f"[{prompt.kind}] {prompt.text!r} -> {out.text!r}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="refengine report", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF-format checkpoint folder (default: the embedded model)")
    p.add_argument(
        "--num-spec-tokens",
        dest="num_speculative_tokens",
        type=int_at_least(1),
        default=DEFAULT_NUM_SPEC_TOKENS,
        help=f"K, the MTP drafts per step (default {DEFAULT_NUM_SPEC_TOKENS})",
    )
    p.add_argument("--max-tokens", type=int_at_least(1), default=DEFAULT_MAX_TOKENS)
    p.add_argument("--samples", type=int_at_least(0), default=len(DEFAULT_PROMPTS),
                   help="sample continuations to print")
    p.add_argument("--threads", type=int_at_least(1), default=1,
                   help="torch intra-op threads (default 1: the model is tiny, more threads only contend)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    add_dtype_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from refengine.tools.errors import SETUP_ERRORS, report

    try:  # a bad checkpoint or device fails the warm-up's engine, before any timing
        # first-call allocations: untimed
        run_workload(args.model, 0, 2, device=args.device, dtype=args.dtype)
        plain = run_workload(args.model, 0, args.max_tokens, device=args.device, dtype=args.dtype)
        spec = run_workload(
            args.model, args.num_speculative_tokens, args.max_tokens, device=args.device, dtype=args.dtype
        )
    except SETUP_ERRORS as e:
        return report("refengine report", e)
    print(
        format_report(plain, spec, acceptance_stats(spec.outputs, args.num_speculative_tokens), args.samples)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
