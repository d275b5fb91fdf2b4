"""Reference for ``gdn_gating``: the Gated DeltaNet's per-token, per-value-head gates, in float32.

``g = -exp(A_log) * softplus(a + dt_bias)`` (the log-decay, <= 0; softplus is ``x`` above 20, as
torch's) and ``beta = 1 / (1 + exp(-b))``, each element from its own inputs alone, so a token's gates do
not depend on the other tokens. ``torch.sigmoid`` and ``F.softplus`` are not used: on CPU they treat a
tensor's tail elements on another code path, which would make a row's bits depend on the row count.
"""

from __future__ import annotations

import torch

from kernels.activation.naive import sigmoid_fp32, softplus_fp32
from kernels.gdn_gating.contract import check_gdn_gating_inputs


def naive_gdn_gating(a_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
                     b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``A_log, dt_bias [Hv]``, ``a, b [T, Hv]`` -> ``g, beta [T, Hv]`` float32."""
    check_gdn_gating_inputs(a_log, a, dt_bias, b)
    g = -torch.exp(a_log.float()) * softplus_fp32(a.float() + dt_bias.float())  # [T, Hv]
    return g, sigmoid_fp32(b.float())
