"""``refengine generate``: run prompts through an engine and print tokens, finish reason, acceptance."""

from __future__ import annotations

import argparse
import sys
import time


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="refengine", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate greedily from prompts")
    g.add_argument("--model", default=None, help="HF-format checkpoint folder (default: the embedded model)")
    g.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    g.add_argument("--prompt-ids", action="append", type=_parse_ids, default=[],
                   help="a prompt as comma-separated token ids (repeatable)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--num-spec-tokens", type=int, default=0)
    g.add_argument("--drafter", default="mtp", choices=("mtp", "ngram", "scripted"))
    g.add_argument("--engine", default="reference", choices=("reference", "async"))
    g.add_argument("--graph-mode", default="none", help="async engine: none | piecewise | full | full_and_piecewise")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: small models)")
    sub.add_parser("report", help="acceptance and speed figures of the default model", add_help=False)
    sub.add_parser("bench", help="async vs reference tokens/s on the default workload", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "report":
        from refengine.tools.report import main as report_main

        return report_main(argv[1:]) or 0
    if argv and argv[0] == "bench":
        from refengine.tools.bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    import torch

    from refengine import LLM, SamplingParams
    from refengine.tools.errors import REQUEST_ERRORS, SETUP_ERRORS, report

    torch.set_num_threads(args.threads)
    prompts = list(args.prompt) + list(args.prompt_ids)
    if not prompts:
        print("refengine generate: give at least one --prompt or --prompt-ids", file=sys.stderr)
        return 2
    try:
        llm = LLM(model=args.model, engine=args.engine, num_speculative_tokens=args.num_spec_tokens,
                  drafter=args.drafter, graph_mode=args.graph_mode, device=args.device)
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    except SETUP_ERRORS as e:
        return report("refengine generate", e)
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    except REQUEST_ERRORS as e:
        return report("refengine generate", e)
    for prompt, o in zip(prompts, outs):
        print(f"prompt: {prompt!r}")
        if o.text is not None:
            print(f"text: {o.text!r}")
        print(f"tokens: {o.token_ids}")
        print(f"finish_reason: {o.finish_reason}")
        if args.num_spec_tokens:
            steps = len(o.acceptance)
            mean = 1 + o.num_accepted_tokens / steps if steps else 1.0
            print(f"drafts: {o.num_draft_tokens} proposed, {o.num_accepted_tokens} accepted "
                  f"over {steps} verify steps (acceptance length {mean:.2f})")
    total = sum(len(o.token_ids) for o in outs)
    print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
