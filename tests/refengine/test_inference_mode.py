"""A CPU engine computes in inference mode (``Engine._inference_mode``): a step there is bound by the cost
of dispatching many small ops, and inference mode drops autograd's part of it. The tensors a step creates
are then inference tensors, which may be written in place only in that mode: requests added and aborted
between steps are still served exactly. A CUDA engine keeps the default mode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from refengine import LLM, SamplingParams
from refengine.engine import Engine


@pytest.mark.parametrize("engine", ["reference", "async"])
def test_a_cpu_engine_computes_in_inference_mode_and_serves_requests_added_and_aborted_between_steps(engine):
    llm = LLM(engine=engine, num_speculative_tokens=2, enable_prefix_caching=True, block_size=4)
    modes: list[bool] = []  # the async engine's forwards run on its device thread: recorded there
    llm.engine.model.register_forward_pre_hook(lambda *_: modes.append(torch.is_inference_mode_enabled()))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = LLM(engine=engine, num_speculative_tokens=2).generate([[5, 6, 7, 8, 9]], params)[0]

    llm.add_request("a", [1, 2, 3, 4, 5, 6, 7], params)
    llm.add_request("b", [3, 4, 5], params)
    llm.step()
    llm.step()
    llm.abort("a")
    llm.add_request("c", [5, 6, 7, 8, 9], params)  # written into state the steps before created
    done = {}
    while llm.has_unfinished():
        done.update((out.request_id, out) for out in llm.step())
    assert modes and all(modes), modes
    assert done["c"].token_ids == alone.token_ids
    assert llm.occupancy().empty


@pytest.mark.parametrize("device, inference", [("cpu", True), ("cuda", False), ("cuda:1", False)])
def test_only_a_cpu_engine_uses_inference_mode(device, inference):
    fake = SimpleNamespace(core=SimpleNamespace(config=SimpleNamespace(device=device)))
    with Engine._inference_mode(fake):
        assert torch.is_inference_mode_enabled() is inference
