"""The interpreter's bounds check (kernels/_bounds.py) that every CPU kernel test runs under."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import requires_triton

pytestmark = [requires_triton, pytest.mark.skipif(torch.cuda.is_available(),
                                                  reason="compiled kernels: a GPU memory checker's job")]


def test_this_tritons_interpreter_can_be_bounds_checked():
    """Every kernel test runs under the check where it can (tests/kernels/conftest.py); a Triton whose
    interpreter moved the internals it wraps fails here, once, instead of silently unchecked."""
    from kernels._bounds import unavailable

    assert unavailable() is None, unavailable()


def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(x, y, n, n_read, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(y + offs, tl.load(x + offs, mask=offs < n_read, other=0.0), mask=offs < n)

    return copy


@pytest.mark.parametrize("n_read,n_write,expected", [
    (9, 8, "load of 1 lane"),  # one lane past x's storage
    (8, 9, "store of 1 lane"),  # one lane past y's
])
def test_a_lane_past_its_tensor_is_refused(n_read, n_write, expected):
    from kernels._bounds import OutOfBounds, bounds_checked

    copy = _copy_kernel()
    x, y = torch.randn(8), torch.zeros(8)
    with bounds_checked(), pytest.raises(Exception, match=expected) as raised:
        copy[(1,)](x, y, n_write, n_read, BLOCK=16)
    assert isinstance(raised.value, OutOfBounds) or isinstance(raised.value.__cause__, OutOfBounds)
    assert "outside every tensor argument" in str(raised.value) and "(8,) torch.float32" in str(raised.value)


def test_masked_lanes_and_views_of_a_wider_storage_pass():
    """Masked-out lanes may point anywhere; a view may read the rest of its storage (one allocation)."""
    from kernels._bounds import bounds_checked

    copy = _copy_kernel()
    base = torch.randn(16)
    x, y = base[:8], torch.zeros(16)
    with bounds_checked():
        copy[(1,)](x, y, 16, 12, BLOCK=16)  # reads 12 lanes of an 8-element view of 16 elements
    assert torch.equal(y[:12], base[:12]) and not y[12:].any()
