"""What a step changes in its requests is written in one place, ``refengine.postprocess``.

Drafters return their proposals and write no request state; the engines build ``RowOutcome``s and
hand them to the writer; nothing else in the package assigns the fields a step advances.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest

from refengine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2] / "refengine"

# The request fields a processed step changes, and the modules allowed to write them: the post-step
# writer; the scheduler, which sets them up at admission and resets them at preemption and finish; the
# async host's optimistic bookkeeping (placeholder drafts and counts at planning, taken back at processing).
STEP_FIELDS = ("num_computed_tokens", "num_valid", "draft_token_ids", "output_token_ids", "num_verify_steps",
               "num_draft_tokens", "num_accepted_tokens", "acceptance", "finish_reason", "stop_reason",
               "logprobs", "stop_text_checked", "stop_text_end")
WRITERS = {"postprocess.py", "scheduler.py", "async_engine/optimistic.py"}


def _is_request(node: ast.AST) -> bool:
    """``req``, ``request``, ``r`` or ``<anything>.request``: how the package names a request."""
    return (isinstance(node, ast.Name) and node.id in ("req", "request", "r")) or (
        isinstance(node, ast.Attribute) and node.attr == "request")


def _writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, field) of every assignment to, or append onto, a request's step field."""
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("append", "extend") and isinstance(node.func.value, ast.Attribute)):
            targets = [node.func.value]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and sub.attr in STEP_FIELDS and _is_request(sub.value):
                    found.append((node.lineno, sub.attr))
    return sorted(found)


def test_only_the_post_step_writer_writes_what_a_step_changes():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in WRITERS:
            continue
        tree = ast.parse(path.read_text())
        offenders += [f"refengine/{rel}:{line} writes .{name}" for line, name in _writes(tree)]
    assert not offenders, ("request state a step changes is written outside refengine.postprocess:\n"
                           + "\n".join(offenders))


def test_the_scan_sees_a_drafter_writing_request_state():
    """The scan above would flag the way drafters used to set drafts themselves."""
    planted = "def propose(rows):\n    for row in rows:\n        row.request.draft_token_ids = [1, 2]\n"
    assert _writes(ast.parse(planted)) == [(3, "draft_token_ids")]
    assert _writes(ast.parse("req.output_token_ids.append(3)\nreq.num_accepted_tokens += 1\n")) == [
        (1, "output_token_ids"), (2, "num_accepted_tokens")]


@pytest.mark.parametrize("drafter", ["mtp", "ngram", "scripted"])
def test_host_proposers_read_committed_requests_and_write_nothing(drafter):
    kw = {"prompt_lookup_min": 1, "prompt_lookup_max": 2} if drafter == "ngram" else {}
    llm = LLM(num_speculative_tokens=2, drafter=drafter, **kw)
    runner = llm.engine.runner
    propose, calls = runner.proposer.propose, []

    def watched(outcomes, result):
        if calls:  # the previous step's proposals are the drafts this step verified, written by the writer
            now = {id(o.request) for o in outcomes}
            for req, p in calls[-1]:
                if p is not None and p.drafts is not None and id(req) in now and not req.is_finished:
                    assert req.draft_token_ids == p.drafts
        before = [copy.deepcopy(vars(o.request)) for o in outcomes]
        proposals = propose(outcomes, result)
        after = [vars(o.request) for o in outcomes]
        assert before == after, f"the {drafter} proposer changed request state"
        calls.append([(o.request, p) for o, p in zip(outcomes, proposals)])
        return proposals

    runner.proposer.propose = watched
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 7, 6, 5, 4, 3], [1, 2, 1, 2, 1, 2]]
    llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert calls, "no step proposed drafts"
    landed = 0
    for step in calls:
        for req, p in step:
            if p is not None and p.drafts is not None:
                assert len(p.drafts) == 2 or drafter == "ngram"
                landed += 1
    assert landed, "no proposal carried drafts"
