"""The async engine's per-slot sampling parameters and seeds (``refengine.sampling`` reads them).

Every admission (new, resumed, on a reused slot) rewrites its slot's rows from the staged writes, the
seed included (a resumed request keeps the seed it was admitted with: its noise is a function of the seed
and the position, so a preemption changes nothing). A greedy request's rows hold temperature 0. The
sink row (padding rows of a FULL step) stays greedy.
"""

from __future__ import annotations

import torch

from refengine.sampling import RowParams


class SamplingRows:
    """``R`` rows (the sink row included)."""

    def __init__(self, num_slots: int, device):
        f32 = {"dtype": torch.float32, "device": device}
        self.temperature = torch.zeros(num_slots, **f32)  # [R] 0: greedy
        self.top_k = torch.zeros(num_slots, dtype=torch.int64, device=device)  # [R] 0: off
        self.top_p = torch.ones(num_slots, **f32)  # [R]
        self.min_p = torch.zeros(num_slots, **f32)  # [R]
        self.seed = torch.zeros(num_slots, dtype=torch.int64, device=device)  # [R]

    @staticmethod
    def staged_writes(w, requests: list) -> None:
        """Add the admitted requests' rows to the staged writes ``w`` (host, in admission order)."""
        floats = torch.tensor([[r.params.temperature, r.params.top_p, r.params.min_p] for r in requests],
                              dtype=torch.float32)
        w.add("sampling.floats", floats)  # [n, 3] temperature, top_p, min_p
        w.add("sampling.top_k", torch.tensor([max(r.params.top_k, 0) for r in requests]))  # [n] 0: off
        w.add("sampling.seed", torch.tensor([r.seed for r in requests], dtype=torch.int64))  # [n]

    def admit(self, idx: torch.Tensor, w: dict) -> None:
        """Rewrite the admitted slots' rows (device timeline; ``w`` the unpacked staged writes)."""
        idx = idx.long()
        floats = w["sampling.floats"]
        self.temperature[idx], self.top_p[idx], self.min_p[idx] = floats.unbind(1)
        self.top_k[idx] = w["sampling.top_k"]
        self.seed[idx] = w["sampling.seed"]

    def rows(self, idx: torch.Tensor) -> RowParams:
        """The parameters of the padded rows whose request slots are ``idx`` [Np] (-1: the sink row)."""
        idx = idx.long()
        return RowParams(self.temperature[idx], self.top_k[idx], self.top_p[idx], self.min_p[idx],
                         self.seed[idx])
