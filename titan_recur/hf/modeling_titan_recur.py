"""Hugging Face wrapper of titan_recur's RecurrentLM, for exported folders loaded with trust_remote_code.

An export ships this file with titan_recur's model code, depth sampler and generation engine
(titan_recur/models/{args,rope,blocks,cache,loss,model,generate}.py, titan_recur/training/recurrence.py) inlined
above it by ``titan_recur.hf.export`` and the ``titan_recur`` imports below removed, so users need torch
and transformers (4.57 or 5.x) only and the exported model runs exactly titan_recur's code. See docs/hf.md.

``generate`` runs titan_recur's generation engine for greedy and sampled decoding, with its
test-time depth knobs (KV sharing, adaptive exit, warm start: docs/generation.md). Other strategies
(beam search, ...) go through transformers' generate and ``forward``, which keeps titan_recur's KV
cache, passed where the installed transformers passes its caches (``cache`` in 5.x,
``past_key_values`` in 4.x); left padding is handled by the attention mask; beam search reorders the
cache rows.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from titan_recur.models.args import ModelArgs
from titan_recur.models.blocks import AttentionContext
from titan_recur.models.cache import KVCache
from titan_recur.inference.engine import GenerationOptions, generate
from titan_recur.models.loss import cross_entropy_loss
from titan_recur.models.model import DEFAULT_BACKPROP_DEPTH, Decoding, NumSteps, RecurrentLM, resolve_num_steps
from titan_recur.training.recurrence import DEFAULT_SEED, DEFAULT_SIGMA, RecurrenceSampler

from .configuration_titan_recur import TitanRecurConfig

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
# Where transformers carries a model's cache between generation steps (outputs and model kwargs).
CACHE_FIELD = "cache" if TRANSFORMERS_MAJOR >= 5 else "past_key_values"
# Call defaults read from the config when absent (configs written before they existed, from_config).
CALL_DEFAULTS: dict[str, Any] = {
    "num_steps": None,
    "backprop_depth": DEFAULT_BACKPROP_DEPTH,
    "recurrence_sigma": DEFAULT_SIGMA,
    "recurrence_seed": DEFAULT_SEED,
    "recurrence_mean_offset": True,
}
# Generation kwargs handed on to forward; the rest (cache_position, position_ids, ...) the model derives itself.
FORWARD_KWARGS = ("num_steps", "state_init", "use_cache", "output_hidden_states", "output_attentions", "return_dict")


class CheckpointedIteration(nn.Module):
    """The core iteration under transformers' gradient checkpointing: each grad-carrying iteration is
    recomputed in backward (``gradient_checkpointing_enable`` sets the two attributes below)."""

    def __init__(self, iteration: nn.Module) -> None:
        super().__init__()
        self.iteration = iteration
        self.gradient_checkpointing = False

    def forward(self, state: torch.Tensor, injected: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(self.iteration.__call__, state, injected, ctx)
        return self.iteration(state, injected, ctx)


class TitanRecurForCausalLM(PreTrainedModel, GenerationMixin):
    """``model(input_ids, num_steps=r)``: r core iterations (default ``config.mean_recurrence``).

    In eval mode (or without grad) r iterations run without grad. A training forward (train mode,
    grad enabled) that names no depth samples (n, k) as titan_recur's trainer does; an int r runs r
    iterations whose last min(r, ``config.backprop_depth``) carry grad; ``num_steps=(n, k)`` is used as given.
    """

    config_class = TitanRecurConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    # accelerate's device maps keep the core (its loop reads the adapter and all blocks) and each block whole.
    _no_split_modules = ["RecurrentCore", "TransformerBlock"]
    # A tied model's head is a Linear sharing the embedding's weight (transformers' way of tying).
    _tied_weights_keys = (
        {"model.lm_head.weight": "model.embed_tokens.weight"} if TRANSFORMERS_MAJOR >= 5 else ["model.lm_head.weight"]
    )

    def __init__(self, config: TitanRecurConfig) -> None:
        super().__init__(config)
        self.model = RecurrentLM(ModelArgs.from_dict(config.titan_recur))
        if self.model.core is not None:
            self.model.core.iteration = CheckpointedIteration(self.model.core.iteration)
        if self.model.lm_head is None:
            # titan_recur ties structurally (no head module); transformers ties a head module's weight to the
            # embedding, which accelerate's offload hooks, PEFT and resize_token_embeddings act on.
            self.model.lm_head = nn.Linear(self.model.args.dim, self.model.args.vocab_size, bias=False)
        # Training forwards drawn so far: seeds the next depth draw (see draw_num_steps).
        self.depth_draws = 0
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # titan_recur's own init (from_config); an export's weights then load over it.
        if isinstance(module, RecurrentLM):
            module.init_weights()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # The cache is titan_recur's KVCache, created by the first forward call.
        return False

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.model.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.model.lm_head = value

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> nn.Embedding:
        """transformers' resize, with the architecture's vocab_size kept in step (saved configs reload)."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        self.model.args.vocab_size = embeddings.num_embeddings
        self.config.titan_recur = {**self.config.titan_recur, "vocab_size": embeddings.num_embeddings}
        return embeddings

    def call_default(self, name: str) -> Any:
        return getattr(self.config, name, CALL_DEFAULTS[name])

    def resolve_depth(self, num_steps: NumSteps) -> tuple[int, int]:
        """(n no-grad, k grad) iterations of a call; see the class docstring."""
        if num_steps is None:
            num_steps = self.call_default("num_steps")
        training = self.training and torch.is_grad_enabled()
        if num_steps is None and training:
            return self.draw_num_steps()
        if num_steps is None:
            num_steps = self.config.mean_recurrence
        backprop_depth = self.call_default("backprop_depth") if training else None
        return resolve_num_steps(num_steps, self.model.args, backprop_depth=backprop_depth)

    def draw_num_steps(self) -> tuple[int, int]:
        """(n, k) of a training forward: titan_recur's Poisson-lognormal sampler around ``mean_recurrence``.

        Draw i is seeded with (recurrence_seed, step=i), i = ``depth_draws``, a count of this model's
        training forwards: every data-parallel rank draws the same depths without communicating, and
        the global RNG is untouched. It restarts at 0 on load; set it to resume a run's sequence.
        """
        sampler = RecurrenceSampler(
            sigma=self.call_default("recurrence_sigma"),
            seed=self.call_default("recurrence_seed"),
            mean_offset=self.call_default("recurrence_mean_offset"),
        )
        steps = sampler.sample(self.config.mean_recurrence, self.call_default("backprop_depth"), step=self.depth_draws)
        self.depth_draws += 1
        return steps

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: KVCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        num_steps: NumSteps = None,
        state_init: str | None = None,
        cache: KVCache | None = None,
    ) -> CausalLMOutputWithPast:
        """Logits of the iterations ``resolve_depth`` gives; ``labels`` (unshifted, -100 ignored) add the mean
        next-token loss.

        hidden_states (``output_hidden_states``): the embeddings, each prelude block's output, the state
        after each core iteration and each coda block's output, the last after the final norm.
        state_init: default ``config.state_init`` in eval mode, the architecture's training init in train mode.
        The output is always a ModelOutput (``return_dict`` is accepted because transformers passes it).
        """
        if output_attentions:
            raise ValueError("output_attentions is not supported: attention runs in scaled_dot_product_attention")
        cache = cache if cache is not None else past_key_values
        depth = self.resolve_depth(num_steps)
        if use_cache and cache is None:  # sized for this call; it grows as generation goes on
            tokens = input_ids if input_ids is not None else inputs_embeds
            cache = KVCache.for_model(self.model, tokens.shape[0], tokens.shape[1], num_steps=sum(depth))
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        states: list[torch.Tensor] = []
        logits = self.model(
            input_ids,
            depth,
            attention_mask=attention_mask,
            state_init=state_init or (None if self.training else self.config.state_init),
            inputs_embeds=inputs_embeds,
            on_hidden_state=states.append if output_hidden_states else None,
            decoding=Decoding(cache=cache, position_ids=position_ids),
        )
        loss = None if labels is None else cross_entropy_loss(logits[:, :-1], labels[:, 1:])
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            # transformers' convention: the last layer's output is given after the final norm.
            hidden_states=(*states[:-2], states[-1]) if output_hidden_states else None,
            **{CACHE_FIELD: cache},
        )

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The positions the cache does not hold yet (all of them, or the prompt's embeddings, at first)."""
        cache = kwargs.get(CACHE_FIELD)
        inputs: dict[str, Any] = {"attention_mask": attention_mask, "cache": cache}
        past = cache.length if cache is not None else 0
        if inputs_embeds is not None and past == 0:
            inputs["inputs_embeds"] = inputs_embeds
        else:
            uncached = kwargs.get("next_sequence_length")  # transformers 5 names it; 4.x always passes a mask
            if uncached is None:
                uncached = (attention_mask.shape[1] if attention_mask is not None else input_ids.shape[1]) - past
            inputs["input_ids"] = input_ids[:, input_ids.shape[1] - uncached :]
        inputs.update({k: kwargs[k] for k in FORWARD_KWARGS if k in kwargs})
        return inputs

    @staticmethod
    def _reorder_cache(cache: KVCache | None, beam_idx: torch.LongTensor) -> KVCache | None:
        """Beam search: each beam continues the cache rows of the beam it extends."""
        if cache is not None:
            cache.reorder(beam_idx)
        return cache

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
        knobs: num_steps (default config.num_steps, else config.mean_recurrence), kv_sharing,
        exit_criterion, exit_threshold, min_steps, check_every, state_init ("previous": warm start), seed (sampling). Supported
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
            max_new_tokens=max_new_tokens, num_steps=num_steps or self.call_default("num_steps") or self.config.mean_recurrence,
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
