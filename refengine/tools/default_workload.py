"""The default workload: a fixed mix of text prompts for the embedded default model.

Used by ``refengine.tools.report`` (acceptance and speed figures), the default-model tests, and anything
else that wants a small, honest, repeatable text workload. The mix:

- ``held-out``: openings of standard-library docstrings from modules the training corpus leaves
  out (``refengine.tools.corpus.HELD_OUT_MODULES``), so the model has never seen the text;
- ``open``: a plain English opening that appears nowhere verbatim in the corpus;
- ``predictable``: sequences the synthetic grammar teaches (a story template, counting, number
  words, the alphabet, a repeated phrase), whose continuation is obvious.

Five of the twelve prompts are predictable; seven are prose the model has not seen.
"""

from __future__ import annotations

from dataclasses import dataclass

from refengine.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 64
DEFAULT_NUM_SPEC_TOKENS = 3


@dataclass(frozen=True)
class WorkloadPrompt:
    text: str
    kind: str  # "held-out" | "open" | "predictable"
    source: str  # where the text comes from


DEFAULT_PROMPTS: tuple[WorkloadPrompt, ...] = (
    WorkloadPrompt("Wrap a single paragraph of text, returning a list of wrapped lines.", "held-out",
                   "textwrap.wrap"),
    WorkloadPrompt("Remove any common leading whitespace from every line in", "held-out", "textwrap.dedent"),
    WorkloadPrompt("This class implements rational numbers.", "held-out", "fractions.Fraction"),
    WorkloadPrompt("Return an iterator for one month. The iterator will yield", "held-out",
                   "calendar.Calendar.itermonthdates"),
    WorkloadPrompt("A generally useful event scheduler class.", "held-out", "sched.scheduler"),
    WorkloadPrompt("Remove an event from the queue.", "held-out", "sched.scheduler.cancel"),
    WorkloadPrompt("The function returns the number of", "open", "documentation-style sentence"),
    WorkloadPrompt("Once upon a time", "predictable", "the synthetic grammar's story template"),
    WorkloadPrompt("1 2 3 4 5 6 7 8", "predictable", "counting"),
    WorkloadPrompt("one two three four", "predictable", "number words"),
    WorkloadPrompt("a b c d e f", "predictable", "alphabet"),
    WorkloadPrompt("the old dog ran to the road. the old dog", "predictable", "repeated phrase"),
)


def default_prompts() -> list[str]:
    return [p.text for p in DEFAULT_PROMPTS]


def default_params(max_tokens: int = DEFAULT_MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


def bench_workload(llm, copies: int, seed: int):
    """The default workload for ``llm``, ``copies`` times over (``refengine bench`` and its fake-CUDA host
    bench): the default prompts, or token prompts of the same lengths for a checkpoint without a tokenizer."""
    import torch

    prompts = default_prompts()
    if llm.tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        vocab = llm.model_config.vocab_size
        prompts = [torch.randint(0, vocab, (len(p),), generator=g).tolist() for p in prompts]
    return prompts * copies, default_params()
