"""An EAGLE head's config.json, read the way vLLM 0.33 reads it (``llama_eagle.py``, ``llama_eagle3.py``).

Fields: the Llama ones (``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``num_hidden_layers``, ``rms_norm_eps``, ``rope_theta``,
``vocab_size``) and the EAGLE-3 ones: ``draft_vocab_size`` (default ``vocab_size``), ``target_hidden_size``
(default ``hidden_size``), ``eagle_aux_hidden_state_layer_ids`` (top level, or in ``eagle_config`` as
``eagle_aux_hidden_state_layer_ids`` / ``layer_ids``), ``norm_before_residual``. ``norm_before_fc``,
``fc_norm`` and ``norm_output`` set, or a ``rope_scaling``, are refused (not served here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

EAGLE1, EAGLE3 = "eagle", "eagle3"
METHODS = (EAGLE1, EAGLE3)


class EagleHeadError(ValueError):
    """An EAGLE head that cannot be served: the message names the field or tensor and the head's folder."""


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's default auxiliary layer ids for a target of ``num_layers`` layers: (2, L//2, L-3), sorted and
    deduplicated (fewer than 7 layers collapse them: 4 layers give (1, 2))."""
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))


def _int(raw: dict, name: str, default=None, where: str = "") -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EagleHeadError(f"{where}config.json: {name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class EagleHeadConfig:
    method: str  # "eagle" | "eagle3"
    hidden_size: int  # H of the head
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int  # decoder layers (EAGLE-3: the one midlayer)
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # as the head names them (sorted); None: vLLM's default
    norm_before_residual: bool

    @classmethod
    def from_dict(cls, raw: dict, method: str, where: str = "") -> EagleHeadConfig:
        if method not in METHODS:
            raise EagleHeadError(f"EAGLE method must be one of {METHODS}, got {method!r}")
        for name in ("norm_before_fc", "fc_norm", "norm_output"):
            if raw.get(name):
                raise EagleHeadError(f"{where}config.json: {name}=true is not served (only vLLM's default "
                                     f"EAGLE-3 layout)")
        if raw.get("rope_scaling"):
            raise EagleHeadError(f"{where}config.json: rope_scaling {raw['rope_scaling']!r} is not served")
        hidden = _int(raw, "hidden_size", where=where)
        heads = _int(raw, "num_attention_heads", where=where)
        vocab = _int(raw, "vocab_size", where=where)
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        eagle_config = raw.get("eagle_config") or {}
        if ids is None and isinstance(eagle_config, dict):
            ids = eagle_config.get("eagle_aux_hidden_state_layer_ids", eagle_config.get("layer_ids"))
        if ids is not None:
            if (not isinstance(ids, list | tuple) or not ids
                    or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)):
                raise EagleHeadError(f"{where}config.json: eagle_aux_hidden_state_layer_ids must be a list "
                                     f"of layer ids >= 0, got {ids!r}")
            ids = tuple(sorted(ids))  # vLLM sorts them
        eps = raw.get("rms_norm_eps", 1e-6)
        theta = raw.get("rope_theta", 10000.0)
        return cls(
            method=method,
            hidden_size=hidden,
            intermediate_size=_int(raw, "intermediate_size", where=where),
            num_attention_heads=heads,
            num_key_value_heads=_int(raw, "num_key_value_heads", heads, where),
            head_dim=_int(raw, "head_dim", hidden // heads, where),
            num_hidden_layers=1 if method == EAGLE3 else _int(raw, "num_hidden_layers", 1, where),
            rms_norm_eps=float(eps),
            rope_theta=float(theta),
            vocab_size=vocab,
            draft_vocab_size=_int(raw, "draft_vocab_size", vocab, where),
            target_hidden_size=_int(raw, "target_hidden_size", hidden, where),
            aux_layer_ids=ids if method == EAGLE3 else None,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
        )

    @classmethod
    def read(cls, path: str | Path, method: str) -> EagleHeadConfig:
        path = Path(path)
        file = path / "config.json"
        if not file.is_file():
            raise EagleHeadError(f"EAGLE head {path}: no config.json (draft_model must be the head's folder)")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise EagleHeadError(f"EAGLE head {file}: not valid JSON ({e})") from None
        return cls.from_dict(raw, method, where=f"EAGLE head {path}: ")

    def aux_ids_for(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose input (the state after that many layers) EAGLE-3 reads."""
        if self.aux_layer_ids is not None:
            return self.aux_layer_ids
        return default_aux_layer_ids(num_target_layers)
