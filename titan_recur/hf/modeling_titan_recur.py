"""Hugging Face wrapper of titan_recur's RecurrentLM, for exported folders loaded with trust_remote_code.

An export ships this file with titan_recur's model code (titan_recur/models/{args,rope,blocks,cache,model,
loss,generate}.py) inlined above it by ``titan_recur.hf.export``, and the ``titan_recur`` imports below removed, so users
need torch and transformers only and the exported model runs exactly titan_recur's code.

``generate`` runs titan_recur's generation engine for greedy and sampled decoding, with its
test-time depth knobs (KV sharing, adaptive exit, warm start: docs/generation.md); other strategies go
through transformers' generate and ``forward``, which keeps titan_recur's KV cache (returned as
``cache``). Left padding is handled by the attention mask.
"""

from __future__ import annotations

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from titan_recur.models.args import ModelArgs
from titan_recur.models.cache import KVCache
from titan_recur.models.generate import GenerationOptions, generate
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
        num_steps = num_steps if num_steps is not None else self.config.mean_recurrence
        if use_cache and cache is None:
            cache = KVCache.for_model(self.model, input_ids.shape[0], input_ids.shape[1], num_steps=num_steps)
        logits = self.model(
            input_ids,
            num_steps,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            state_init=state_init or self.config.state_init,
        )
        loss = None if labels is None else cross_entropy_loss(logits[:, :-1], labels[:, 1:])
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        num_steps: int | None = None,
        kv_sharing: str = "full",
        exit_criterion: str | None = None,
        exit_threshold: float | None = None,
        min_steps: int = 1,
        check_every: int = 1,
        state_init: str | None = None,
        seed: int = 0,
        **kwargs,
    ) -> torch.LongTensor:
        """Prompt + new tokens (B, T + N), as transformers' generate returns them.

        Greedy and sampled decoding (num_beams = 1) run titan_recur's engine with its test-time depth
        knobs: num_steps (default config.mean_recurrence), kv_sharing, exit_criterion, exit_threshold,
        min_steps, check_every, state_init ("previous": warm start), seed (sampling). Supported
        transformers arguments: max_new_tokens, max_length, do_sample, temperature, top_p,
        eos_token_id, pad_token_id, stopping_criteria, use_cache. Anything else (beam search, ...)
        goes through transformers' generate and ``forward`` at depth num_steps.
        """
        config = self.generation_config
        if (kwargs.get("num_beams") or config.num_beams or 1) > 1 or set(kwargs) - _ENGINE_KWARGS:
            if kv_sharing != "full" or exit_criterion is not None or state_init == "previous":
                raise ValueError("kv_sharing, exit_criterion and warm start need greedy or sampled decoding (num_beams=1)")
            return super().generate(input_ids, attention_mask=attention_mask, num_steps=num_steps,
                                    state_init=state_init, **kwargs)
        width = input_ids.shape[1]
        max_new_tokens = kwargs.get("max_new_tokens") or config.max_new_tokens
        if max_new_tokens is None:
            max_new_tokens = (kwargs.get("max_length") or config.max_length) - width
        eos = kwargs.get("eos_token_id", None)
        eos = config.eos_token_id if eos is None else eos
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        pad = kwargs.get("pad_token_id", config.pad_token_id)
        sample = kwargs.get("do_sample", config.do_sample)
        options = GenerationOptions(
            max_new_tokens=max_new_tokens, num_steps=num_steps if num_steps is not None else self.config.mean_recurrence,
            kv_sharing=kv_sharing, exit_criterion=exit_criterion, exit_threshold=exit_threshold, min_steps=min_steps,
            check_every=check_every, state_init=state_init or self.config.state_init,
            temperature=kwargs.get("temperature", config.temperature) if sample else 0.0,
            top_p=kwargs.get("top_p", config.top_p) if sample else 1.0, seed=seed,
            eos_id=eos_ids[0] if eos_ids else None,
        )
        criteria = kwargs.get("stopping_criteria")
        more_eos = torch.tensor(eos_ids[1:], dtype=torch.long, device=input_ids.device)

        def stop(new_tokens: torch.Tensor) -> torch.Tensor:
            done = torch.isin(new_tokens[:, -1], more_eos)
            if criteria:
                done = done | criteria(torch.cat([input_ids, new_tokens], dim=1), None)
            return done

        out = generate(self.model, input_ids, options, attention_mask=attention_mask,
                       stop=stop if criteria or more_eos.numel() else None)
        tokens = out.tokens
        if pad is not None:  # as transformers does: pad after a row finished
            columns = torch.arange(tokens.shape[1], device=tokens.device)
            tokens = tokens.masked_fill(columns >= out.lengths[:, None], pad)
        return torch.cat([input_ids, tokens], dim=1)


# transformers' generate arguments the engine path serves (see TitanRecurForCausalLM.generate).
_ENGINE_KWARGS = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_p", "eos_token_id", "pad_token_id",
                  "stopping_criteria", "use_cache", "num_beams"}
