"""How much the prefix cache serves: cached tokens over queried tokens, on shared-prefix and multi-turn
workloads, for each mode (``align``, ``all``) and K (0, and 3 with the MTP drafter).

    python -m refengine.prefix_cache.bench [--model DIR] [--block-size 4] [--engine reference]

Workloads (random token ids from a fixed seed, greedy, ``ignore_eos``; every request is sent once the
previous one finished, so what an earlier request left can be hit):

- ``shared-prefix``: groups of requests sharing a system prompt (lengths on and off the block grid),
  each with its own suffix;
- ``multi-turn``: conversations whose next turn's prompt is the previous prompt, its reply and a new
  user message.

A row reads ``cached / queried``: the prefix cache's hit and lookup counters (``LLM.occupancy()``),
queried being every prompt token looked up at admission. Only the public ``LLM`` API is used, so the
same file measures any version of the engine on the path.
"""

from __future__ import annotations

import argparse
import random
import sys

from refengine import LLM, SamplingParams

MAX_TOKENS = 7


def shared_prefix(rng: random.Random, vocab: int) -> list:
    """Waves of one prompt each: per group, a system prompt and three suffixes."""
    waves = []
    for system_len in (8, 12, 13, 19):
        system = [rng.randrange(vocab) for _ in range(system_len)]
        for suffix_len in (1, 4, 6):
            waves.append([system + [rng.randrange(vocab) for _ in range(suffix_len)]])
    return waves


def multi_turn(rng: random.Random, vocab: int) -> list:
    """Waves of one prompt each: per conversation, three turns, each extending the last with its reply."""
    waves = []
    for first_len in (8, 11, 12, 17):
        first = [rng.randrange(vocab) for _ in range(first_len)]
        waves.append([first])
        for _ in range(2):
            user = [rng.randrange(vocab) for _ in range(rng.randrange(2, 7))]
            waves.append(lambda outs, user=user: [outs[-1].prompt_token_ids + outs[-1].token_ids + user])
    return waves


WORKLOADS = {"shared-prefix": shared_prefix, "multi-turn": multi_turn}
SETTINGS = [("align", 0), ("align", 3), ("all", 0), ("all", 3)]  # (mode, K with the MTP drafter)


def measure(model: str | None, workload: str, mode: str, k: int, block_size: int,
            engine: str) -> tuple[int, int]:
    """(cached tokens, queried tokens) of one workload under one setting."""
    llm = LLM(model=model, engine=engine, block_size=block_size, num_speculative_tokens=k, drafter="mtp",
              enable_prefix_caching=True, mamba_cache_mode=mode, max_model_len=256)
    vocab = llm.engine.core.model_config.vocab_size
    waves = WORKLOADS[workload](random.Random(0), vocab)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = []
    for wave in waves:
        outs += llm.generate(wave(outs) if callable(wave) else wave, params)
    occ = llm.occupancy()
    return occ.prefix_cache_hits, occ.prefix_cache_queries


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m refengine.prefix_cache.bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--engine", default="reference", choices=("reference", "async"))
    args = p.parse_args(argv)
    print(f"block size {args.block_size}, {args.engine} engine, {MAX_TOKENS} output tokens per request")
    print(f"{'workload':<14} {'mode':<6} {'K':>2} {'cached':>7} {'queried':>8} {'ratio':>7}")
    for workload in WORKLOADS:
        for mode, k in SETTINGS:
            hits, queries = measure(args.model, workload, mode, k, args.block_size, args.engine)
            print(f"{workload:<14} {mode:<6} {k:>2} {hits:>7} {queries:>8} {hits / max(queries, 1):>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
