"""The five phases of the chunked gated delta rule, each Triton kernel against its torch reference.

Each phase gets its inputs from the references of the phases before it, so a kernel is checked alone.
The Triton launches write into buffers full of NaN: the tokens inside rows must match the reference and
every other entry (tokens past ``cu[N]``, slots no chunk uses, rows without a state slot where the
phase skips them) must still be NaN, so a lane that strays is seen even where it lands inside the
buffer (the bounds check of tests/kernels/conftest.py sees the ones that leave it). Under the
interpreter the grids are kept to a handful of programs; the shape matrix runs under ``-m slow``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels._contract import KernelInputError
from kernels._testing import assert_close
from kernels.constants import PAD_SLOT_ID
from kernels.gated_delta_rule import naive_chunk_gated_delta_rule, naive_phases, phases
from tests.kernels.conftest import requires_triton
from tests.kernels.slot_contract import cu_seqlens_for, make_pool

RATIO = 1e-5  # float32 products on both sides under the interpreter; the GPU's tf32x3 sits near it
GPU_RATIO = 2e-3  # a compiled kernel on a GPU: tf32x3 products and another summation order

PHASES = ("cumsum", "solve", "wy", "state", "output")


def ratio() -> float:
    return GPU_RATIO if torch.cuda.is_available() else RATIO


class Case:
    """Inputs for rows of ``lens`` tokens (plus ``extra`` tokens past the last row), and every phase's
    reference result, so each phase can be fed its reference inputs."""

    def __init__(self, lens, hk, hv, dk, dv, bt, *, extra=2, pad_row=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        t = sum(lens) + extra
        self.lens, self.bt, self.n = list(lens), bt, len(lens)
        self.q = torch.randn(t, hk, dk, generator=g)
        self.k = torch.randn(t, hk, dk, generator=g)
        self.v = torch.randn(t, hv, dv, generator=g)
        self.g = F.logsigmoid(torch.randn(t, hv, generator=g) + 2.0)
        self.beta = torch.rand(t, hv, generator=g)
        self.cu = cu_seqlens_for(lens)
        self.idx = torch.randperm(self.n + 2, generator=g)[: self.n].to(torch.int32)
        if pad_row is not None:
            self.idx[pad_row] = PAD_SLOT_ID
        self.has_init = torch.tensor([i % 2 == 0 for i in range(self.n)])
        self.pool = make_pool(self.n + 2, (hv, dk, dv), [s for s in self.idx.tolist() if s != PAD_SLOT_ID])
        self.scale = dk ** -0.5
        dev = [x.to(torch.get_default_device()) for x in (self.q, self.k, self.v, self.g, self.beta)]
        self.q, self.k, self.v, self.g, self.beta = dev
        self.cu, self.idx, self.has_init = (x.to(self.q.device) for x in (self.cu, self.idx, self.has_init))
        self.pool = self.pool.to(self.q.device)
        self.gc = naive_phases.chunk_cumsum(self.g, self.cu, bt)
        self.a_inv, self.rk = naive_phases.chunk_solve(self.k, self.beta, self.gc, self.cu, bt)
        self.w, self.u = naive_phases.chunk_wy(self.k, self.v, self.beta, self.gc, self.a_inv, self.rk,
                                               self.cu, bt)
        self.ref_pool = self.pool.clone()
        self.h, self.vnew = naive_phases.chunk_state(self.k, self.w, self.u, self.gc, self.rk, self.ref_pool,
                                                     self.cu, self.idx, self.has_init, bt)
        self.o = naive_phases.chunk_output(self.q, self.k, self.vnew, self.gc, self.h, self.cu, self.idx, bt,
                                           self.scale)

    def token_mask(self, skip_pad: bool) -> torch.Tensor:
        """The tokens a phase writes: inside a row (and, with ``skip_pad``, a row with a state slot)."""
        m = torch.zeros(self.q.shape[0], dtype=torch.bool, device=self.q.device)
        for i, (a, b) in enumerate(zip(self.cu[:-1].tolist(), self.cu[1:].tolist())):
            m[a:b] = not (skip_pad and int(self.idx[i]) == PAD_SLOT_ID)
        return m

    def slot_mask(self) -> torch.Tensor:
        """The chunk slots phase 4 writes: every chunk of a row with a state slot."""
        m = torch.zeros(self.h.shape[0], dtype=torch.bool, device=self.q.device)
        for i, slot, _, _ in naive_phases.chunks(self.cu, self.bt):
            m[slot] = int(self.idx[i]) != PAD_SLOT_ID
        return m


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def check_written(name: str, ref: torch.Tensor, out: torch.Tensor, written: torch.Tensor) -> None:
    """``out`` equals ``ref`` where ``written`` (over the first dimension) and is still NaN elsewhere."""
    assert_close(name, ref[written], out[written], ratio())
    assert not torch.isnan(out[written]).any(), f"{name}: an entry the phase must write is NaN"
    assert torch.isnan(out[~written]).all(), f"{name}: the phase wrote outside its rows"


def run_phase(phase: str, c: Case) -> None:
    """Launch phase ``phase`` of the Triton form on ``c``'s reference inputs and check it."""
    from kernels.gated_delta_rule.triton_chunk_cumsum import launch_cumsum
    from kernels.gated_delta_rule.triton_chunk_output import launch_output
    from kernels.gated_delta_rule.triton_chunk_solve import launch_solve
    from kernels.gated_delta_rule.triton_chunk_state import launch_state
    from kernels.gated_delta_rule.triton_chunk_wy import launch_wy

    rows = c.token_mask(skip_pad=False)
    if phase == "cumsum":
        gc = nan_like(c.gc)
        launch_cumsum(c.g, c.cu, c.bt, gc)
        check_written("gc", c.gc, gc, rows)
    elif phase == "solve":
        a_inv, rk = nan_like(c.a_inv), nan_like(c.rk)
        launch_solve(c.k, c.beta, c.gc, c.cu, c.bt, True, False, a_inv, rk)
        check_written("a_inv", c.a_inv, a_inv, rows)
        check_written("rk", c.rk, rk, rows)
    elif phase == "wy":
        w, u = nan_like(c.w), nan_like(c.u)
        launch_wy(c.k, c.v, c.beta, c.gc, c.a_inv, c.rk, c.cu, c.bt, w, u)
        check_written("w", c.w, w, rows)
        check_written("u", c.u, u, rows)
    elif phase == "state":
        h, vnew, pool = nan_like(c.h), c.u.clone(), c.pool.clone()
        vnew[~c.token_mask(skip_pad=True)] = float("nan")
        launch_state(c.k, c.w, vnew, c.gc, c.rk, pool, c.cu, c.idx, c.has_init, c.bt, h)
        check_written("h", c.h, h, c.slot_mask())
        check_written("v'", c.vnew, vnew, c.token_mask(skip_pad=True))
        live = [s for s, n in zip(c.idx.tolist(), c.lens) if s != PAD_SLOT_ID and n > 0]
        assert_close("final states", c.ref_pool[live], pool[live], ratio())
        others = torch.ones(pool.shape[0], dtype=torch.bool)
        others[live] = False
        assert torch.equal(pool[others], c.pool[others]), "a pool slot no row owns was written"
    else:
        o = nan_like(c.o)
        launch_output(c.q, c.k, c.vnew, c.gc, c.h, c.cu, c.idx, c.bt, c.scale, True, False, o)
        check_written("o", c.o, o, c.token_mask(skip_pad=True))


# Three rows, one of length 0, a partial chunk, one key head for two value heads, Dk = 40 in a 64-wide
# tile, Dv over two 32-wide value tiles (the second partial), tokens past the last row, two 16-token
# blocks per chunk (more key tiles and key heads: the matrix below and test_gated_delta_rule.py).
DEFAULT = {"lens": [33, 0, 5], "hk": 1, "hv": 2, "dk": 40, "dv": 40, "bt": 32}


@requires_triton
@pytest.mark.parametrize("phase", PHASES)
def test_phase_matches_its_reference(phase):
    run_phase(phase, Case(**DEFAULT, pad_row=2 if phase in ("state", "output") else None))


MATRIX = [  # lens, Hk, Hv, Dk, Dv, BT
    ([1, 17], 1, 1, 16, 16, 16),
    ([65, 3], 2, 4, 16, 12, 64),       # the Dk = 16 / chunk 64 shape of the H100 run
    ([64, 64, 1], 1, 2, 128, 128, 64),  # whole chunks, Dk = Dv = 128
    ([40], 1, 1, 256, 20, 32),          # four key tiles, the most the state kernel holds
    ([90, 0, 33], 2, 2, 100, 70, 64),
]


@requires_triton
@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("lens,hk,hv,dk,dv,bt",
                         [pytest.param(*m, id="L{}-Hk{}-Hv{}-Dk{}-Dv{}-BT{}".format(*m)) for m in MATRIX])
def test_phase_matches_its_reference_matrix(phase, lens, hk, hv, dk, dv, bt):
    run_phase(phase, Case(lens, hk, hv, dk, dv, bt, pad_row=len(lens) - 1 if len(lens) > 2 else None))


@pytest.mark.cpu_only
@pytest.mark.parametrize("bt", [16, 32, 64])
def test_chained_phase_references_are_the_chunked_reference(bt):
    """The five references chained compute what ``naive_chunk_gated_delta_rule`` does (varlen rows, a
    padding row, initial states read and skipped)."""
    c = Case([70, 0, 9, 30], 2, 4, 20, 12, bt, pad_row=2)
    p_phases, p_ref = c.pool.clone(), c.pool.clone()
    args = (c.q, c.k, c.v, c.g, c.beta)
    o_phases = naive_phases.compose(*args, p_phases, c.cu, c.idx, c.has_init, chunk_size=bt)
    o_ref = naive_chunk_gated_delta_rule(*args, p_ref, c.cu, c.idx, c.has_init, chunk_size=bt)
    assert_close("o", o_ref, o_phases, 1e-5)
    assert torch.equal(p_phases.isnan(), p_ref.isnan())
    assert_close("pool", p_ref, p_phases, 1e-5)


def _phase_calls(c: Case):
    return {
        "cumsum": lambda b: phases.chunk_cumsum(c.g, c.cu, c.bt, backend=b),
        "solve": lambda b: phases.chunk_solve(c.k, c.beta, c.gc, c.cu, c.bt, backend=b),
        "wy": lambda b: phases.chunk_wy(c.k, c.v, c.beta, c.gc, c.a_inv, c.rk, c.cu, c.bt, backend=b),
        "state": lambda b: phases.chunk_state(c.k, c.w, c.u, c.gc, c.rk, c.pool.clone(), c.cu, c.idx,
                                              c.has_init, c.bt, backend=b),
        "output": lambda b: phases.chunk_output(c.q, c.k, c.vnew, c.gc, c.h, c.cu, c.idx, c.bt, c.scale,
                                                backend=b),
    }


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
def test_each_phase_refuses_a_chunk_size_its_kernels_lack(backend):
    """Both backends of every phase check the phase's contract first."""
    c = Case([3], 1, 1, 16, 16, 16, extra=0)
    c.bt = 48
    for phase, call in _phase_calls(c).items():
        expected = r"chunk_size must be one of \(16, 32, 64\), got 48"
        with pytest.raises(KernelInputError, match=expected) as err:
            call(backend)
        assert err.value.op == f"chunk_{phase}"


@requires_triton
def test_phase_entry_points_run_the_kernels():
    """``kernels.gated_delta_rule.phases`` runs each Triton phase through its contract (one row, one chunk
    of 16): the same results as the references."""
    c = Case([5], 1, 1, 16, 16, 16, extra=0)
    calls = _phase_calls(c)
    assert_close("gc", c.gc, calls["cumsum"]("triton"), ratio())
    a_inv, rk = calls["solve"]("triton")
    assert_close("a_inv", c.a_inv, a_inv, ratio())
    assert_close("rk", c.rk, rk, ratio())
    w, u = calls["wy"]("triton")
    assert_close("w", c.w, w, ratio())
    assert_close("u", c.u, u, ratio())
    h, vnew = calls["state"]("triton")
    assert_close("v'", c.vnew, vnew, ratio())
    assert_close("h", c.h[:1], h[:1], ratio())
    assert_close("o", c.o, calls["output"]("triton"), ratio())
