"""Views the async engine makes once and reuses (issue 47's host cost): they must follow a change of shape or
of the tensor they view, and give the bits the per-call forms gave."""

from __future__ import annotations

import torch

from refengine.async_engine.graphs import StepGraphs
from refengine.async_engine.inputs import StagedWrites, StepRows
from refengine.model.layers import PartialRotary


def test_the_row_views_follow_the_padded_size_and_the_table():
    graphs = StepGraphs(torch.device("cpu"), max_rows=8, width=StepRows.width(2))
    graphs._buffer.copy_(torch.arange(8 * StepRows.width(2)).reshape(8, -1))
    four, eight = graphs.rows(graphs.table(4)), graphs.rows(graphs.table(8))
    assert four.idx.shape == (4,) and eight.idx.shape == (8,), "a cached view of another padded size"
    assert graphs.rows(graphs.table(4)) is four
    assert torch.equal(four.checkpoint_slots, graphs.table(4)[:, -2:])
    other = torch.zeros(4, StepRows.width(2), dtype=torch.int64)  # another tensor of the same rows
    assert torch.equal(graphs.rows(other).idx, other[:, 0]), "a cached view of a table it was not given"


def test_unpacked_pieces_keep_their_dtypes_shapes_and_values():
    w = StagedWrites()
    pieces = {"a": torch.arange(5), "b": torch.tensor([True, False, True]), "c": torch.rand(3, 2),
              "d": torch.arange(6, dtype=torch.int32).reshape(2, 3),
              "e": torch.zeros(0, 2, dtype=torch.int64),
              "f": torch.arange(7, dtype=torch.int64).reshape(7, 1),
              "g": torch.tensor([3, 4], dtype=torch.int16)}
    for name, t in pieces.items():
        w.add(name, t)
    out = w.unpack(w.packed().clone())
    for name, t in pieces.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape and torch.equal(out[name], t), name


def _rope_per_tensor(rope: PartialRotary, x, positions):
    """The rotation as it was written before (rotate_half by negation and concatenation, per tensor)."""
    cos, sin = rope.cos_sin(positions)
    rd, half = rope.rotary_dim, rope.rotary_dim // 2
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    rot, rest = x[..., :rd], x[..., rd:]
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def test_rope_by_roll_has_the_bits_of_rotate_half():
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 4096, (37,), generator=g)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rd, d in ((8, 32), (32, 32)):
            rope = PartialRotary(rd, 10000.0)
            q = torch.randn(37, 4, d, generator=g).to(dtype)
            k = torch.randn(37, 2, d, generator=g).to(dtype)
            q2, k2 = rope(q, k, positions)
            assert torch.equal(q2, _rope_per_tensor(rope, q, positions)), (dtype, rd)
            assert torch.equal(k2, _rope_per_tensor(rope, k, positions)), (dtype, rd)
