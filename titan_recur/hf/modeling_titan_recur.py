"""Hugging Face wrapper of titan_recur's RecurrentLM, for exported folders loaded with trust_remote_code.

An export ships this file with titan_recur's model code (titan_recur/models/{args,rope,blocks,model}.py)
inlined above it by ``titan_recur.hf.export``, and the ``titan_recur`` imports below removed, so users
need torch and transformers only and the exported model runs exactly titan_recur's code.

Generation keeps titan_recur's own KV cache (one slot per core block and iteration), returned as
``cache`` like transformers' caches; left padding is handled by the attention mask.
"""

from __future__ import annotations

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from titan_recur.models.args import ModelArgs
from titan_recur.models.blocks import KVCache
from titan_recur.models.loss import cross_entropy_loss
from titan_recur.models.model import RecurrentLM

from .configuration_titan_recur import TitanRecurConfig


class TitanRecurForCausalLM(PreTrainedModel, GenerationMixin):
    """``model(input_ids, num_steps=r)``: r core iterations (default ``config.mean_recurrence``), no grad."""

    config_class = TitanRecurConfig
    base_model_prefix = "model"

    def __init__(self, config: TitanRecurConfig) -> None:
        super().__init__(config)
        self.model = RecurrentLM(ModelArgs.from_dict(config.titan_recur))
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        # titan_recur's own init (from_config); an export's weights then load over it.
        if isinstance(module, RecurrentLM):
            module.init_weights()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # The cache is titan_recur's KVCache, created by the first forward call.
        return False

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module | None:
        # None when tied: the model projects with the embedding matrix itself.
        return self.model.lm_head

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: KVCache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        num_steps: int | None = None,
        state_init: str | None = None,
        return_dict: bool | None = None,
    ) -> CausalLMOutputWithPast:
        """Logits of r = ``num_steps`` iterations; ``labels`` (unshifted, -100 ignored) add the mean next-token loss.

        The output is always a ModelOutput (``return_dict`` is accepted because ``generate`` passes it).
        """
        if use_cache and cache is None:
            cache = KVCache()
        logits = self.model(
            input_ids,
            num_steps if num_steps is not None else self.config.mean_recurrence,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            state_init=state_init or self.config.state_init,
        )
        loss = None if labels is None else cross_entropy_loss(logits[:, :-1], labels[:, 1:])
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)
