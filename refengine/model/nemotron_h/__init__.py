"""The Nemotron-H family: Mamba2, attention, relu² MLP and MoE blocks by the config's pattern, and a
one-step MTP draft head.

``config.py`` the config view, ``model.py`` the model and its cache specs, ``weights.py`` the checkpoint
layout, ``mamba2.py`` its Mamba2 mixer, ``mtp_head.py`` the head ``add-mtp-head`` writes, ``tiny.py``
the weights of ``tiny:nemotron_h``. ``FAMILY`` is its registry entry.
"""

from refengine.model.family import ModelFamily
from refengine.model.nemotron_h.config import MODEL_TYPE, NemotronHConfig
from refengine.model.nemotron_h.model import NemotronHForCausalLM, NemotronHMTPHead, cache_specs
from refengine.model.nemotron_h.mtp_head import nemotron_mtp_head
from refengine.model.nemotron_h.tiny import write_tiny_checkpoint
from refengine.model.nemotron_h.weights import NemotronHWeights

FAMILY = ModelFamily(
    name="nemotron_h",
    model_types=(MODEL_TYPE,),
    config_from_dict=NemotronHConfig.from_hf_config,
    model_class=NemotronHForCausalLM,
    weights=NemotronHWeights(),
    cache_specs=cache_specs,
    # read as vLLM does, beside transformers' configuration class
    config_fields=frozenset({"num_nextn_predict_layers", "hybrid_override_pattern",
                             "mtp_hybrid_override_pattern", "layers_block_type"}),
    mtp_head=nemotron_mtp_head,
    tiny_checkpoint=write_tiny_checkpoint,
    test_checkpoints=(),  # not yet run on the fake-CUDA tier
)

__all__ = ["FAMILY", "NemotronHConfig", "NemotronHForCausalLM", "NemotronHMTPHead"]
