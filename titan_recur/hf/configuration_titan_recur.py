"""Hugging Face config of an exported titan_recur model (shipped verbatim into exported folders).

The architecture is the ``titan_recur`` dict (titan_recur's ModelArgs, as in a titan_recur model
folder's config.json, without the two inference defaults below). ``mean_recurrence`` and
``state_init`` are the defaults of every forward/generate call and may be overridden per load
(``from_pretrained(..., mean_recurrence=32)``) or per call (``num_steps=``, ``state_init=``). The
standard HF names (hidden_size, max_position_embeddings, ...) mirror the architecture for HF tools;
the model reads only ``titan_recur``, ``mean_recurrence`` and ``state_init``.
"""

from transformers import PreTrainedConfig


class TitanRecurConfig(PreTrainedConfig):
    model_type = "titan_recur"
