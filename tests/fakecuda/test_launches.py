"""Every Triton launch, up to the launch, on fake CUDA tensors (no GPU, no kernel run).

Each op's wrapper runs on fake CUDA copies of every accepted row of its contract table
(``tests/kernels/test_contracts.py``: the engines' form and every dtype / stride variant), with every
Triton launch replaced by ``kernels._launch_check``'s recorder. A launch passes when each pointer
argument is a CUDA tensor with the dtype and strides the kernel's address arithmetic assumes and the
grid is the one its arguments call for; the wrapper passes when it also reads nothing back to the host
(fake tensors raise on ``.item()`` / ``.tolist()`` / ``bool()``) and creates no tensor on the CPU.
The engines' own calls of the same wrappers are checked by ``test_engines.py``.
"""

from __future__ import annotations

import pytest
import torch

from kernels._launch_check import SPECS, LaunchError
from tests.helpers.fake_cuda import FakeCuda
from tests.kernels.test_contracts import ACCEPTED, OPS

# The engines' form of each op (its first row) in the default tier; every other accepted row under -m slow.
ROWS = [pytest.param(name, row, id=f"{name}-{row.what}",
                     marks=[] if row is op.rows[0] else [pytest.mark.slow])
        for name, op in OPS.items() for row in op.rows if row.expected == ACCEPTED]


def run_wrapper(name: str, inputs: dict):
    """``OPS[name]`` on fake CUDA copies of ``inputs``: (launches, CPU-producing ops, outputs)."""
    with FakeCuda() as fc:
        fake = fc.like(inputs)
        with fc.watching() as watch:
            out = OPS[name].fn(**fake, backend="triton")
        outputs = [] if out is None else [out] if isinstance(out, torch.Tensor) else list(out)
        return fc.launches.launches, watch.cpu_ops, outputs


@pytest.mark.parametrize("name,row", ROWS)
def test_wrapper_launches_what_its_kernel_assumes(name, row):
    launches, cpu_ops, outputs = run_wrapper(name, row.make())
    assert not cpu_ops, f"{name} created tensors on the CPU: {cpu_ops}"
    assert all(t.is_cuda for t in outputs), f"{name} returned a tensor off the GPU"
    if "triton" in OPS[name].backends:  # the others (moe_route, moe_route_sigmoid) are plain torch ops
        assert launches, f"{name} launched no kernel"
    else:
        assert not launches, f"{name} is a torch op on every device, yet launched {launches}"


def test_every_kernel_has_a_launch_spec():
    """A kernel added without a spec would fail at its first recorded launch; this names them all at once."""
    launched = set()
    for name, op in OPS.items():
        launches, _, _ = run_wrapper(name, op.rows[0].make())
        launched |= {launch.kernel for launch in launches}
    assert launched == set(SPECS), f"kernels launched {sorted(launched)}, specs {sorted(SPECS)}"


def test_an_index_tensor_built_on_the_host_fails_the_launch(monkeypatch):
    """A planted bug: the wrapper's int32 conversion of an index tensor built without ``device=`` (on a GPU:
    "Pointer argument cannot be accessed from Triton (cpu tensor?)")."""
    from kernels.input_prep import triton_input_prep

    def as_index_on_host(x, dtype=torch.int32):
        if x is None or x.dtype == dtype:
            return x
        return torch.empty(x.shape, dtype=dtype).copy_(x)  # no device=

    monkeypatch.setattr(triton_input_prep, "as_index", as_index_on_host)
    row = next(r for r in OPS["prepare_inputs"].rows if r.what.startswith("int64 idx_mapping"))
    with pytest.raises(LaunchError, match="pointer argument idx_mapping is on cpu"):
        run_wrapper("prepare_inputs", row.make())


def test_a_host_read_in_a_wrapper_fails(monkeypatch):
    """A planted bug: a wrapper that sizes its grid from a tensor's value (a device sync on a GPU)."""
    from kernels.verify import triton_greedy_verify

    check = triton_greedy_verify.check_greedy_verify_inputs

    def reads_back(*args):
        n, k = check(*args)
        return int(args[2].max()) if n else n, k  # num_draft_tokens read on the host

    monkeypatch.setattr(triton_greedy_verify, "check_greedy_verify_inputs", reads_back)
    with pytest.raises(Exception, match="data-dependent|DataDependent|_local_scalar_dense"):
        run_wrapper("greedy_verify", OPS["greedy_verify"].rows[0].make())


def test_a_state_block_narrower_than_the_state_fails(monkeypatch):
    """A planted bug: a state block ``BN`` that covers half of N (the kernel masks the rest off and
    silently drops it), refused by the spec's requirement."""
    from kernels.mamba2 import triton_state_update

    config = triton_state_update.launch_config

    def half_state(p, n):
        return {**config(p, n), "BN": triton_state_update.triton.next_power_of_2(n) // 2}

    monkeypatch.setattr(triton_state_update, "launch_config", half_state)
    with pytest.raises(LaunchError, match=r"selective_state_update_kernel: the kernel assumes BN >= N"):
        run_wrapper("selective_state_update", OPS["selective_state_update"].rows[0].make())


def _linear_launch(grid, x, w, y, stride_x=None):
    from kernels.linear import triton_linear as tl_

    m, k = x.shape
    tl_.linear_kernel[grid](x, w, y, m, w.shape[0], k, x.stride(0) if stride_x is None else stride_x,
                            w.stride(0), y.stride(0), BM=tl_.BM, BN=tl_.BN, BK=tl_.BK, MATMUL="dot")


@pytest.mark.parametrize("fault,expected", [
    ("grid", r"grid \(1, 1\) differs from the \(2, 1\)"),
    ("stride", "pointer argument x .* has strides"),
    ("dtype", "pointer argument w is torch.bfloat16"),
    ("tensor grid", "grid axis 0 is .*not a plain int"),
    ("grid limit", "grid axis 1 is 70000, outside CUDA's 0 to 65535"),
    ("host tensor", "pointer argument y is on cpu"),
])
def test_the_launch_check_refuses(fault, expected):
    """The checker itself: a grid, a stride, a dtype or a device the kernel does not expect."""
    with FakeCuda() as fc:
        x = torch.empty(40, 24, device="cuda")
        w = torch.empty(8, 24, device="cuda", dtype=torch.bfloat16 if fault == "dtype" else torch.float32)
        y = torch.empty(40, 8, device="cpu" if fault == "host tensor" else "cuda")
        grid = {"grid": (1, 1), "tensor grid": (torch.ones((), dtype=torch.int64, device="cuda"), 1),
                "grid limit": (2, 70000)}
        with pytest.raises(LaunchError, match=expected):
            _linear_launch(grid.get(fault, (2, 1)), x, w, y, stride_x=48 if fault == "stride" else None)
        assert not fc.launches.launches


def _row_inputs(empty, rows, chunked):
    """cu_seqlens, a pool slot per row and (for the chunked forms) the initial-state flags."""
    inputs = {"cu_seqlens": empty(rows + 1, dtype=torch.int32),
              "state_indices": empty(rows, dtype=torch.int32)}
    if chunked:
        inputs["has_initial_state"] = empty(rows, dtype=torch.bool)
    return inputs


def _mamba2_inputs(empty, rows, chunked):
    """Nemotron-H 8B's Mamba2 layers: 128 heads of 64 x 128, 8 groups."""
    h, p, g, n = 128, 64, 8, 128
    inputs = {"x": empty(rows, h, p), "dt": empty(rows, h), "A": empty(h), "B": empty(rows, g, n),
              "C": empty(rows, g, n), "D": empty(h), "ssm_state": empty(rows + 1, h, p, n)}
    return {**inputs, **_row_inputs(empty, rows, chunked)}


def _gdn_inputs(empty, rows, chunked):
    """Qwen3-Next's gated delta rule layers: 16 key heads and 32 value heads of 128 x 128."""
    hk, hv, d = 16, 32, 128
    inputs = {"q": empty(rows, hk, d), "k": empty(rows, hk, d), "v": empty(rows, hv, d), "g": empty(rows, hv),
              "beta": empty(rows, hv), "ssm_state": empty(rows + 1, hv, d, d)}
    return {**inputs, **_row_inputs(empty, rows, chunked)}


# Per op: (rows, heads, the inputs for that many one-token rows, chunked form, the kernels it launches).
WIDE_BATCHES = {
    "selective_state_update": (1024, 128, _mamba2_inputs, False, {"selective_state_update_kernel"}),
    "ssd_chunk_scan": (1024, 128, _mamba2_inputs, True, {"ssd_state_kernel", "ssd_output_kernel"}),
    "fused_recurrent_gated_delta_rule": (2048, 32, _gdn_inputs, False,
                                         {"fused_recurrent_gated_delta_rule_fwd_kernel"}),
    "chunk_gated_delta_rule": (2048, 32, _gdn_inputs, True,
                               {"chunk_gdn_cumsum_kernel", "chunk_gdn_solve_kernel", "chunk_gdn_wy_kernel",
                                "chunk_gdn_state_kernel", "chunk_gdn_output_kernel"}),
}


@pytest.mark.parametrize("name", list(WIDE_BATCHES))
def test_a_wide_batch_stays_inside_the_grid_limits(name):
    """One-token rows times heads past the 65535 programs CUDA allows on a grid's y and z axes (on a GPU
    the launch fails with an invalid-argument error), so the wrappers must put rows x heads on x: 1024 rows
    of Nemotron-H 8B's 128 Mamba2 heads, 2048 rows of Qwen3-Next's 32 value heads. Fake tensors: no memory
    for the multi-GiB state pools."""
    import kernels

    rows, heads, make, chunked, launched = WIDE_BATCHES[name]
    assert rows * heads > 65535, "the batch must be wide enough to overflow axis 1"
    with FakeCuda() as fc:
        def empty(*shape, dtype=torch.float32):
            return torch.empty(shape, dtype=dtype, device="cuda")

        getattr(kernels, name)(**make(empty, rows, chunked), backend="triton")
        assert {launch.kernel for launch in fc.launches.launches} == launched
