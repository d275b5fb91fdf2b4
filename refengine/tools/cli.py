"""``refengine generate``: run prompts through an engine and print tokens, finish reason, acceptance.
The prompts go in at once (``--mode batch``), one after another (``sequential``: with
``--enable-prefix-caching`` a later prompt is served from what an earlier one cached), or as the turns of
one chat (``chat``: each turn's prompt is the previous turn's prompt and reply followed by its own text).
``refengine add-mtp-head SRC DST``: a copy of a checkpoint with an MTP head (refengine.tools.mtp_head).
``refengine add-eagle-head SRC DST``: an EAGLE-1 / EAGLE-3 head for a checkpoint (refengine.tools.eagle_head).
``refengine report`` and ``refengine bench``: refengine.tools.report and refengine.tools.bench."""

from __future__ import annotations

import argparse
import re
import sys
import time

# Parsing imports no torch (a test holds it to that): --help and usage errors answer at once; the engine,
# the tools and the error classes they raise load in the command functions.
from refengine.config import DEFAULT_ASYNC_GRAPH_MODE, GRAPH_MODES
from refengine.tools.errors import (
    OneLineParser,
    add_dtype_flag,
    docstring_of,
    finite_number,
    int_at_least,
    one_line_warnings,
    report,
)

MODES = ("batch", "sequential", "chat")


def graph_mode_for(engine: str, graph_mode: str | None) -> str:
    """The graph mode a command runs ``engine`` in: the one asked for, else the async default (the
    reference engine has none)."""
    if graph_mode is not None:
        return graph_mode
    return DEFAULT_ASYNC_GRAPH_MODE if engine == "async" else "none"


def describe_graph_mode(engine: str, graph_mode: str) -> str:
    """``graph mode full_and_piecewise, `` for the async engine, "" for the reference engine (it has none):
    what every summary names."""
    return f"graph mode {graph_mode}, " if engine == "async" else ""


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids wants comma-separated integers, got {text!r}"
        ) from None


def _parse_bias(text: str) -> tuple[int, float]:
    try:
        t, b = text.split("=")
        return int(t), float(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants ID=BIAS (say 42=-5.0), got {text!r}") from None


def _ids_for():
    def parse(text: str) -> list[int]:
        try:
            return [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"wants comma-separated integers, got {text!r}") from None
    return parse


def add_request_flags(g) -> None:
    """The request's parameters (``SamplingParams``, vLLM's names and meanings); the engine validates them
    and a refusal names the flag."""
    r = g.add_argument_group("request parameters (vLLM's SamplingParams)")
    r.add_argument("--temperature", type=finite_number, default=0.0,
                   help=">= 0; 0: greedy decoding (default), else sample (seeded: --request-seed)")
    r.add_argument("--top-k", type=int_at_least(-1), default=0,
                   help="sample from the K likeliest ids (0 or -1: all)")
    r.add_argument("--top-p", type=finite_number, default=1.0,
                   help="(0, 1]: sample from the likeliest ids whose mass reaches it")
    r.add_argument("--min-p", type=finite_number, default=0.0,
                   help="[0, 1]: drop ids below min-p times the top probability")
    r.add_argument("--request-seed", type=int_at_least(0), default=None, metavar="N",
                   help="the request's sampling seed (SamplingParams.seed; default: drawn, and printed)")
    r.add_argument("--stop-token-ids", type=_ids_for(), default=None, metavar="IDS",
                   help="comma-separated ids that stop a request (finish_reason stop, stop_reason the id)")
    r.add_argument("--min-tokens", type=int_at_least(0), default=0,
                   help="no stop before this many output tokens")
    # the penalties' ranges are the request's own (it refuses a value out of range naming the flag)
    r.add_argument("--presence-penalty", type=finite_number, default=0.0,
                   help="[-2, 2], once per id in the output")
    r.add_argument("--frequency-penalty", type=finite_number, default=0.0,
                   help="[-2, 2], per occurrence in output")
    r.add_argument("--repetition-penalty", type=finite_number, default=1.0,
                   help="> 0, over prompt and output ids")
    r.add_argument("--logit-bias", type=_parse_bias, action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS to id ID's logit (repeatable)")
    r.add_argument("--allowed-token-ids", type=_ids_for(), default=None, metavar="IDS",
                   help="comma-separated ids: only these may be chosen")
    r.add_argument("--bad-words", action="append", default=None, metavar="WORD",
                   help="a word never completed (repeatable; needs the checkpoint's tokenizer)")
    r.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="a stop string (repeatable; needs the checkpoint's tokenizer)")
    r.add_argument("--include-stop-str-in-output", action="store_true",
                   help="keep the stop string at the end of the text")
    r.add_argument("--logprobs", type=int_at_least(0), default=None, metavar="N",
                   help="print the top-N raw logprobs of each output token (the chosen one always)")
    r.add_argument("--prompt-logprobs", type=int_at_least(0), default=None, metavar="N",
                   help="print the top-N raw logprobs of each prompt token after the first (it always)")
    s = r.add_mutually_exclusive_group()  # structured outputs: one constraint (needs the tokenizer)
    s.add_argument("--json-schema", default=None, metavar="JSON",
                   help="hold the output to this JSON schema (structured_outputs.json)")
    s.add_argument("--regex", default=None, help="hold the output to this regular expression")
    s.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="the output is one of these strings (repeatable)")
    s.add_argument("--grammar", default=None, metavar="EBNF", help="hold the output to this EBNF grammar")


def request_params(args) -> dict:
    """The SamplingParams fields the request flags give."""
    return {
        "stop_token_ids": args.stop_token_ids, "min_tokens": args.min_tokens,
        "presence_penalty": args.presence_penalty, "frequency_penalty": args.frequency_penalty,
        "repetition_penalty": args.repetition_penalty, "logit_bias": dict(args.logit_bias) or None,
        "allowed_token_ids": args.allowed_token_ids, "bad_words": args.bad_words, "stop": args.stop,
        "include_stop_str_in_output": args.include_stop_str_in_output, "logprobs": args.logprobs,
        "prompt_logprobs": args.prompt_logprobs, "temperature": args.temperature, "top_k": args.top_k,
        "top_p": args.top_p, "min_p": args.min_p, "seed": args.request_seed,
        "structured_outputs": _structured_outputs(args),
    }


def _structured_outputs(args) -> dict | None:
    given = {"json": args.json_schema, "regex": args.regex, "choice": args.choice, "grammar": args.grammar}
    given = {k: v for k, v in given.items() if v is not None}
    return given or None


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="refengine", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate greedily from prompts")
    g.add_argument("--model", default=None, help="HF-format checkpoint folder, hub id in the local cache or "
                   "tiny:<preset> (default: the embedded model)")
    g.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    g.add_argument("--prompt-ids", action="append", type=_parse_ids, default=[],
                   help="a prompt as comma-separated token ids (repeatable)")
    g.add_argument("--mode", default="batch", choices=MODES,
                   help="batch: every prompt at once (default); sequential: one after another, each after "
                   "the previous finished; chat: the prompts are the turns of one conversation, each turn's "
                   "prompt being the previous turn's prompt and reply followed by its own")
    g.add_argument("--max-tokens", type=int_at_least(1), default=32,
                   help="most tokens per prompt (at most the model length minus the prompt; said when "
                   "capped)")
    g.add_argument("--num-spec-tokens", dest="num_speculative_tokens", type=int_at_least(0), default=0)
    g.add_argument("--drafter", default="mtp", choices=("mtp", "ngram", "scripted", "draft_model", "eagle",
                                                       "eagle3"))
    g.add_argument("--draft-model", default=None, metavar="PATH",
                   help="--drafter draft_model: the draft checkpoint (same vocabulary as --model; "
                   "`refengine make-draft-model` cuts one from a checkpoint; or tiny:<preset>); --drafter "
                   "eagle|eagle3: the head's folder (vLLM's layout; `refengine add-eagle-head`), or "
                   "tiny:eagle3 for its head")
    g.add_argument("--prompt-lookup-min", type=int_at_least(1), default=None,
                   help="--drafter ngram: shortest n-gram looked up (default 5)")
    g.add_argument("--prompt-lookup-max", type=int_at_least(1), default=None,
                   help="--drafter ngram: longest n-gram looked up (default 5)")
    g.add_argument("--engine", default="reference", choices=("reference", "async"))
    g.add_argument("--graph-mode", default=None,
                   help=f"async engine: {' | '.join(GRAPH_MODES)} (default {DEFAULT_ASYNC_GRAPH_MODE}, as "
                   "for every command that runs 'async')")
    g.add_argument("--seed", type=int_at_least(0), default=0, help="engine seed (default 0)")
    g.add_argument("--block-size", type=int_at_least(1), default=16, help="KV block size in tokens "
                   "(default 16; also the prefix cache's granularity)")
    g.add_argument("--max-num-seqs", type=int_at_least(1), default=16,
                   help="most requests running at once (default 16)")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    add_dtype_flag(g, "the engine")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--enable-prefix-caching", action="store_true",
                   help="share KV blocks and recurrent checkpoints between prompts with a common prefix")
    g.add_argument(
        "--mamba-cache-mode",
        default=None,
        help="with --enable-prefix-caching: align (default) | all; where recurrent states are kept",
    )
    add_request_flags(g)
    g.add_argument(
        "--threads", type=int_at_least(1), default=1, help="torch intra-op threads (default 1: small models)"
    )
    sub.add_parser("report", help="acceptance and speed figures of the default model", add_help=False)
    sub.add_parser("bench", help="async vs reference tokens/s on the default workload", add_help=False)
    mtp = sub.add_parser("add-mtp-head", help="copy a checkpoint saved without an MTP head (as transformers "
                         "saves one) and add a head initialised from the model's own layers",
                         description=docstring_of("refengine.tools.mtp_head"),
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    mtp.add_argument("src", metavar="SRC", help="checkpoint folder without mtp.* tensors")
    mtp.add_argument("dst", metavar="DST", help="new folder: SRC's files plus the head")
    cut = sub.add_parser("make-draft-model", help="cut a checkpoint to some of its layers: a draft model "
                         "with its vocabulary (--drafter draft_model)",
                         description=docstring_of("refengine.tools.draft_model"),
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    cut.add_argument("src", metavar="SRC", help="checkpoint folder (or tiny:<family>)")
    cut.add_argument("dst", metavar="DST", help="new folder: the draft model")
    cut.add_argument("--layers", required=True, help="the first N layers, indices such as 0,3, or all")
    eagle = sub.add_parser("add-eagle-head", help="make an EAGLE-1 / EAGLE-3 head (vLLM's layout) for a "
                           "checkpoint, to serve with --drafter eagle|eagle3 --draft-model DST",
                           description=docstring_of("refengine.tools.eagle_head"),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    eagle.add_argument("src", metavar="SRC", help="the target checkpoint folder")
    eagle.add_argument("dst", metavar="DST", help="new folder: the head's config.json and model.safetensors")
    eagle.add_argument("--method", default="eagle3", choices=("eagle", "eagle3"))
    eagle.add_argument("--aux-ids", type=_parse_ids, default=None, metavar="I,J,K",
                       help="eagle3: the target layers whose input the head reads (default 1, L//2, L-1)")
    eagle.add_argument("--draft-vocab-size", type=int_at_least(1), default=None,
                       help="eagle3: a draft vocabulary of this many ids, with d2t (default: the whole "
                       "vocabulary)")
    eagle.add_argument("--seed", type=int_at_least(0), default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    """The ``refengine`` command. Called without ``argv`` it is the process's entry point and ends the
    process with the command's status (130 on Ctrl-C) without finalizing the interpreter under the async
    engine's worker thread, which may be inside torch (refengine.tools.exits); with ``argv`` it returns
    the status."""
    if argv is None:
        from refengine.tools.exits import process_main

        process_main(f"refengine {sys.argv[1] if len(sys.argv) > 1 else 'generate'}",
                     lambda: main(sys.argv[1:]))
    command = argv[0] if argv else "generate"
    one_line_warnings(f"refengine {command}")
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback
        print(f"refengine {command}: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    if argv and argv[0] == "report":
        from refengine.tools.report import main as report_main

        return report_main(argv[1:]) or 0
    if argv and argv[0] == "bench":
        from refengine.tools.bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "add-mtp-head":
        return add_mtp_head_command(args.src, args.dst)
    if args.command == "make-draft-model":
        return make_draft_model_command(args.src, args.dst, args.layers)
    if args.command == "add-eagle-head":
        return add_eagle_head_command(args)
    return generate_command(args)


def generate_command(args) -> int:
    import torch

    from refengine import LLM, SamplingParams
    from refengine.tools.errors import REQUEST_ERRORS, SETUP_ERRORS
    from refengine.tools.tiny_models import resolve_draft, resolve_tiny

    torch.set_num_threads(args.threads)
    prompts = list(args.prompt) + list(args.prompt_ids)
    if not prompts:
        print("refengine generate: give at least one --prompt or --prompt-ids", file=sys.stderr)
        return 2
    graph_mode = graph_mode_for(args.engine, args.graph_mode)
    try:
        llm = LLM(model=resolve_tiny(args.model), engine=args.engine,
                  num_speculative_tokens=args.num_speculative_tokens, drafter=args.drafter,
                  prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
                  draft_model=resolve_draft(args.drafter, args.draft_model),
                  graph_mode=graph_mode, device=args.device,
                  dtype=args.dtype, seed=args.seed, block_size=args.block_size,
                  max_num_seqs=args.max_num_seqs, enable_prefix_caching=args.enable_prefix_caching,
                  mamba_cache_mode=args.mamba_cache_mode)
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                                **request_params(args))
    except SETUP_ERRORS as e:
        return report("refengine generate", e)
    try:
        start = time.perf_counter()
        turns = _generate(llm, prompts, params, args.mode)
        elapsed = time.perf_counter() - start
    except REQUEST_ERRORS as e:
        return report("refengine generate", e)
    limit = llm.config.scheduler.max_model_len
    for i, (prompt, ids, o) in enumerate(turns):
        print(f"turn {i}: {prompt!r} (prompt of {len(ids)} tokens, the earlier turns included)"
              if args.mode == "chat" and i else f"prompt: {prompt!r}")
        if args.max_tokens > limit - len(ids):
            print(f"note: --max-tokens {args.max_tokens} is capped at the model length: this prompt of "
                  f"{len(ids)} tokens can generate at most {limit - len(ids)} (max_model_len {limit})")
        if o.text is not None:
            print(f"text: {o.text!r}")
        print(f"tokens: {o.token_ids}")
        print(f"finish_reason: {o.finish_reason}")
        if o.stop_reason is not None:
            print(f"stop_reason: {o.stop_reason!r}")
        if params.samples:
            print(f"seed: {o.seed}")
        if o.logprobs is not None:
            print(f"logprobs: {o.logprobs}")
        if o.prompt_logprobs is not None:
            print(f"prompt_logprobs: {o.prompt_logprobs}")
        if args.num_speculative_tokens:
            steps = len(o.acceptance)
            mean = 1 + o.num_accepted_tokens / steps if steps else 1.0
            print(f"drafts: {o.num_draft_tokens} proposed, {o.num_accepted_tokens} accepted "
                  f"over {steps} verify steps (acceptance length {mean:.2f})")
        if args.enable_prefix_caching:
            print(f"cached_tokens: {o.num_cached_tokens} of {len(ids)} prompt tokens served from the prefix "
                  "cache")
    if args.enable_prefix_caching:
        occ = llm.occupancy()
        print(f"prefix cache: {occ.prefix_cache_hits} of {occ.prefix_cache_queries} looked-up tokens hit")
    total = sum(len(o.token_ids) for _, _, o in turns)
    graph = describe_graph_mode(args.engine, graph_mode)
    print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s); engine {args.engine}, "
          f"dtype {llm.config.dtype}, device {llm.config.device}, {graph}mode {args.mode}, "
          f"K={args.num_speculative_tokens}, seed {args.seed}")
    return 0


def _generate(llm, prompts: list, params, mode: str) -> list[tuple[object, list[int], object]]:
    """(prompt as given, the prompt ids the engine got, its output) per prompt, in ``mode``."""
    if mode == "batch":
        ids = [llm._tokenize(p) for p in prompts]
        return list(zip(prompts, ids, llm.generate(ids, params)))
    turns, history = [], []
    for prompt in prompts:
        ids = history + llm._tokenize(prompt) if mode == "chat" else llm._tokenize(prompt)
        out = llm.generate([ids], params)[0]
        turns.append((prompt, ids, out))
        if mode == "chat":
            history = ids + list(out.token_ids)
    return turns


def add_mtp_head_command(src: str, dst: str) -> int:
    from refengine.tools import mtp_head
    from refengine.tools.errors import SETUP_ERRORS

    try:
        origin = mtp_head.add_mtp_head(src, dst)
    except SETUP_ERRORS as e:
        return report("refengine add-mtp-head", e)
    layers = sorted({m.group(0) for where in origin.values() if (m := re.match(r"^.*?layers\.\d+", where))})
    print(
        f"wrote {dst}: {src} plus an MTP head of {len(origin)} mtp.* tensors in {dst}/{mtp_head.HEAD_FILE}, "
        f"initialised from the model's own layers ({', '.join(layers)}), untrained: "
        "its drafts are valid but rarely accepted until it is trained"
    )
    return 0


def make_draft_model_command(src: str, dst: str, layers: str) -> int:
    from refengine.tools import draft_model
    from refengine.tools.errors import SETUP_ERRORS
    from refengine.tools.tiny_models import resolve_model

    try:
        out = draft_model.make_draft_model(resolve_model(src), dst, layers)
    except SETUP_ERRORS as e:
        return report("refengine make-draft-model", e)
    print(f"wrote {out}: {src} cut to layers {layers} (--drafter draft_model --draft-model {out})")
    return 0


def add_eagle_head_command(args) -> int:
    from refengine.tools import eagle_head
    from refengine.tools.errors import SETUP_ERRORS
    from refengine.tools.tiny_models import resolve_tiny

    try:
        config = eagle_head.add_eagle_head(resolve_tiny(args.src), args.dst, args.method,
                                           aux_ids=args.aux_ids, draft_vocab_size=args.draft_vocab_size,
                                           seed=args.seed)
    except (*SETUP_ERRORS, ValueError) as e:
        return report("refengine add-eagle-head", e)
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    where = f", aux ids {ids}, draft vocabulary {config['draft_vocab_size']}" if ids is not None else ""
    print(f"wrote {args.dst}: an {args.method} head for {args.src} (hidden {config['hidden_size']}{where}), "
          f"untrained: serve it with --drafter {args.method} --draft-model {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
