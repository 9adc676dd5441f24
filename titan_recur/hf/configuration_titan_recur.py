"""Hugging Face config of an exported titan_recur model (shipped verbatim into exported folders).

The architecture is the ``titan_recur`` dict (titan_recur's ModelArgs, as in a titan_recur model
folder's config.json, without the inference defaults below). The call defaults may be overridden
per load (``from_pretrained(..., num_steps=32)``) or per call (``num_steps=``, ``state_init=``):

- ``mean_recurrence``: the depth of a call that names none, and the mean of the depth a training
  forward samples; ``num_steps`` (null by default) overrides the depth of every call that names none;
- ``state_init``: the state init at evaluation (training forwards use the architecture's own);
- ``backprop_depth``, ``recurrence_sigma``, ``recurrence_seed``, ``recurrence_mean_offset``: the
  depth sampler of training forwards (titan_recur's ``[recurrence]`` settings of the same names).

The standard HF names (hidden_size, max_position_embeddings, ...) mirror the architecture for HF
tools; the model reads only ``titan_recur`` and the call defaults (see docs/hf.md).
"""

try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers 4.x
    from transformers import PretrainedConfig as PreTrainedConfig


class TitanRecurConfig(PreTrainedConfig):
    model_type = "titan_recur"
