"""Hugging Face wrapper of titan_recur's RecurrentLM, for exported folders loaded with trust_remote_code.

An export ships this file with titan_recur's model code, depth sampler and generation engine
(titan_recur/models/{args,rope,blocks,cache,loss,model,generate}.py, titan_recur/training/recurrence.py,
titan_recur/storage/manifest_format.py) inlined
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

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import transformers
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput

from titan_recur.inference.engine import generate
from titan_recur.inference.options import GenerationOptions
from titan_recur.models.args import DEFAULT_BACKPROP_DEPTH, WARM_START, ModelArgs
from titan_recur.models.blocks import AttentionContext
from titan_recur.models.cache import KVCache
from titan_recur.models.loss import cross_entropy_loss
from titan_recur.models.model import Decoding, NumSteps, RecurrentLM, resolve_num_steps
from titan_recur.storage.manifest_format import CHECKSUM, MANIFEST_NAME
from titan_recur.training.recurrence import DEFAULT_SEED, DEFAULT_SIGMA, RecurrenceSampler

from .configuration_titan_recur import TitanRecurConfig

logger = transformers.logging.get_logger(__name__)
# The model card of an export, and the line save_pretrained puts at the top of a saved copy's.
CARD_NAME = "README.md"
SAVED_NOTICE = "> Saved with `save_pretrained`"
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
# transformers' warning, given once by every generate path (transformers' own checks the last column only).
RIGHT_PADDING_WARNING = (
    "A decoder-only architecture is being used, but right-padding was detected! For correct generation results, "
    "please set `padding_side='left'` when initializing the tokenizer."
)
# Generation kwargs handed on to forward; the rest (cache_position, position_ids, ...) the model derives itself.
FORWARD_KWARGS = ("num_steps", "state_init", "use_cache", "output_hidden_states", "output_attentions", "return_dict")


class CheckpointedIteration(nn.Module):
    """The core iteration under transformers' gradient checkpointing: each grad-carrying iteration is
    recomputed in backward (``gradient_checkpointing_enable`` sets the two attributes below)."""

    _gradient_checkpointing_func: Callable[..., torch.Tensor]

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
    # Attention always runs in scaled_dot_product_attention: attn_implementation="sdpa" names what runs.
    _supports_sdpa = True
    # accelerate's device maps keep the core (its loop reads the adapter and all blocks) and each block whole.
    _no_split_modules = ["RecurrentCore", "TransformerBlock"]
    # A tied model's head is a Linear sharing the embedding's weight (transformers' way of tying).
    _tied_weights_keys = (
        {"model.lm_head.weight": "model.embed_tokens.weight"} if TRANSFORMERS_MAJOR >= 5 else ["model.lm_head.weight"]  # type: ignore[assignment]
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

    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any, verify_checksums: bool = True, **kwargs: Any
    ) -> TitanRecurForCausalLM:
        """transformers' from_pretrained; a local folder's files are first checked against its manifest.json
        (sizes and xxh3 checksums, as titan_recur wrote them): a corrupt file is refused. ``model.checksums_verified``
        says whether they were (False: ``verify_checksums=False``, no manifest, a Hub id, or no xxhash installed)."""
        folder = Path(pretrained_model_name_or_path)
        verified = verify_checksums and folder.is_dir() and verify_manifest(folder)
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model.checksums_verified = verified  # type: ignore[assignment]
        return model

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        """transformers' save_pretrained (what Trainer and a merged PEFT model call), then the model card of the
        folder this model was loaded from, marked as saved after that load, and a manifest.json of every file:
        a fine-tuned folder describes itself and reloads verified."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if not kwargs.get("is_main_process", True):
            return
        folder, source = Path(save_directory), Path(self.config._name_or_path or "")
        if (source / CARD_NAME).is_file() and source.resolve() != folder.resolve():
            (folder / CARD_NAME).write_text(saved_card((source / CARD_NAME).read_text(), source))
        write_manifest(folder)

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
        token_type_ids: torch.Tensor | None = None,
    ) -> CausalLMOutputWithPast:
        """Logits of the iterations ``resolve_depth`` gives; ``labels`` (unshifted, -100 ignored) add the mean
        next-token loss.

        hidden_states (``output_hidden_states``): the embeddings, each prelude block's output, the state
        after each core iteration and each coda block's output, the last after the final norm.
        state_init: default ``config.state_init`` in eval mode, the architecture's training init in train mode.
        The output is always a ModelOutput (``return_dict`` is accepted because transformers passes it).
        token_type_ids (which transformers 4.x tokenizers return) must be all zero: the model has one token type.
        A row longer than the model's max_seq_len is refused (check_length).
        """
        if output_attentions:
            raise ValueError("output_attentions is not supported: attention runs in scaled_dot_product_attention")
        if token_type_ids is not None and bool(token_type_ids.any()):
            raise ValueError("token_type_ids must be all zero (or omitted): the model has a single token type")
        cache = cache if cache is not None else past_key_values
        depth = self.resolve_depth(num_steps)
        tokens = input_ids if input_ids is not None else inputs_embeds
        if tokens is not None:
            check_length(tokens.shape[1] + (cache.length if cache is not None else 0), attention_mask, self.model.args)
        # Sized for this call; it grows as generation goes on. Without tokens the model refuses the call.
        if use_cache and cache is None and tokens is not None:
            cache = self.new_cache(tokens, sum(depth))
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
        cache_field: dict[str, Any] = {CACHE_FIELD: cache}  # the field's name depends on the transformers version
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            # transformers' convention: the last layer's output is given after the final norm.
            hidden_states=(*states[:-2], states[-1]) if output_hidden_states else None,
            **cache_field,
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
        generation_config: GenerationConfig | None = None,
        generator: torch.Generator | None = None,
        num_steps: int | None = GenerationOptions.num_steps,
        kv_sharing: str = GenerationOptions.kv_sharing,
        exit_criterion: str | None = GenerationOptions.exit_criterion,
        exit_threshold: float | None = GenerationOptions.exit_threshold,
        min_steps: int = GenerationOptions.min_steps,
        check_every: int = GenerationOptions.check_every,
        state_init: str | None = GenerationOptions.state_init,
        seed: int | None = GenerationOptions.seed,
        draft_steps: int | None = GenerationOptions.draft_steps,
        lookahead: int = GenerationOptions.lookahead,
        compile: bool | None = GenerationOptions.compile,
        **kwargs: Any,
    ) -> torch.LongTensor | ModelOutput:
        """Prompt + new tokens (B, T + N), or with ``return_dict_in_generate`` a ``TitanRecurGenerateOutput``.

        The generation config is resolved as transformers' generate resolves it (``generation_config``
        or the model's, then the call's kwargs, then transformers' defaults). Greedy and sampled decoding
        (temperature, top_k, top_p, applied as transformers' warpers apply them) run titan_recur's engine with its
        test-time depth knobs, ``GenerationOptions``' fields of the same names and defaults (see its docstring):
        num_steps (default config.num_steps, else config.mean_recurrence), kv_sharing, exit_criterion,
        exit_threshold, min_steps, check_every, state_init ("previous": warm start; default config.state_init),
        draft_steps and lookahead (speculative decoding over depth) and compile (the fast decode path). Anything
        else (beam search, repetition_penalty, assisted decoding, logits processors, ...) runs
        transformers' generate through ``forward`` at depth num_steps. Sampling draws from ``generator``, else
        from torch's global RNG (``torch.manual_seed``), else from ``seed`` when given.
        """
        config, model_kwargs = self._prepare_generation_config(generation_config, **kwargs)  # type: ignore[misc]
        if config.is_assistant:
            # A draft call of transformers' assisted decoding carries the main model's kwargs: the assistant keeps
            # its own depth (its config's num_steps, else mean_recurrence) and state init.
            num_steps = state_init = None
        if attention_mask is not None and is_right_padded(attention_mask):
            logger.warning(RIGHT_PADDING_WARNING)
        served_inputs = {k: v for k, v in model_kwargs.items() if k not in IGNORED_INPUTS}
        stopping_criteria = served_inputs.pop("stopping_criteria", None)
        blockers = self.engine_blockers(config, served_inputs, input_ids)
        sample = bool(config.do_sample)
        if sample and seed is None:  # the engine's sampling generator is seeded by a draw from torch's RNG
            device = generator.device if generator is not None else "cpu"
            seed = int(torch.randint(2**62, (), generator=generator, device=device))
        if blockers:
            if (
                kv_sharing != GenerationOptions.kv_sharing
                or exit_criterion is not None
                or state_init == WARM_START
                or draft_steps
            ):
                raise ValueError(
                    f"kv_sharing, exit_criterion, warm start and draft_steps run in titan_recur's engine, which cannot serve "
                    f"{', '.join(blockers)} (it serves greedy and sampled decoding: temperature, top_k, top_p)"
                )
            return self.transformers_generate(
                input_ids, attention_mask, generation_config, config, seed, num_steps, state_init, kwargs
            )
        assert input_ids is not None  # else engine_blockers gave "no input_ids"
        width = input_ids.shape[1]
        max_new_tokens = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - width
        eos = config.eos_token_id
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        pad = config.pad_token_id if config.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
        # Greedy: GenerationOptions' temperature, top_p and top_k; sampling: the generation config's (a None:
        # no warper, as in transformers).
        sampling = {}
        if sample:
            temperature, top_p = (1.0 if v is None else v for v in (config.temperature, config.top_p))
            sampling = dict(temperature=temperature, top_p=top_p, top_k=config.top_k or 0)
        options = GenerationOptions.from_values(
            sampling,
            max_new_tokens=max_new_tokens,
            num_steps=num_steps or self.call_default("num_steps") or self.config.mean_recurrence,
            kv_sharing=kv_sharing,
            exit_criterion=exit_criterion,
            exit_threshold=exit_threshold,
            min_steps=min_steps,
            check_every=check_every,
            state_init=state_init or self.config.state_init,
            seed=seed if sample else 0,
            eos_id=eos_ids[0] if eos_ids else None,
            draft_steps=draft_steps,
            lookahead=lookahead,
            compile=compile,
        )
        more_eos = torch.tensor(eos_ids[1:], dtype=torch.long, device=input_ids.device)

        def stop(new_tokens: torch.Tensor) -> torch.Tensor:
            done = torch.isin(new_tokens[:, -1], more_eos)
            if stopping_criteria:
                done = done | stopping_criteria(torch.cat([input_ids, new_tokens], dim=1), None)
            return done

        out = generate(
            self.model,
            input_ids,
            options,
            attention_mask=attention_mask,
            stop=stop if stopping_criteria or more_eos.numel() else None,
            return_logits=bool(config.output_logits),
        )
        tokens = out.tokens
        if pad is not None:  # as transformers does: pad after a row finished
            columns = torch.arange(tokens.shape[1], device=tokens.device)
            tokens = tokens.masked_fill(columns >= out.lengths[:, None], pad)
        sequences = cast(torch.LongTensor, torch.cat([input_ids, tokens], dim=1))  # token ids: int64
        if not config.return_dict_in_generate:
            return sequences
        logits = tuple(out.logits.unbind(1)) if out.logits is not None else None  # given when output_logits
        spec = out.speculation
        return TitanRecurGenerateOutput(
            sequences=sequences,
            logits=logits,  # type: ignore[arg-type]  # transformers annotates it tuple[FloatTensor], one item
            steps=out.steps,
            draft_accepted=None if spec is None else spec.accepted,
            draft_proposed=None if spec is None else spec.drafted,
            core_iterations=None if spec is None else spec.core_iterations,
        )

    def engine_blockers(
        self, config: GenerationConfig, model_kwargs: dict[str, Any], input_ids: torch.Tensor | None
    ) -> list[str]:
        """What of a generate call titan_recur's engine cannot serve (empty: the engine runs it)."""
        blockers = [
            f"{k}={v!r}" for k, v in model_kwargs.items() if v is not None and not (isinstance(v, list) and not v)
        ]
        mode = config.get_generation_mode(model_kwargs.get("assistant_model"))
        if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
            blockers.append(f"{mode.value} decoding")
        defaults = default_generation_config().to_dict()
        blockers += [
            f"{k}={v!r}"
            for k, v in config.to_dict().items()
            if k not in ENGINE_CONFIG_FIELDS and not k.startswith("_") and v != defaults.get(k)
        ]
        if input_ids is None:
            blockers.append("no input_ids")
        elif self.model.embed_tokens.weight.device != input_ids.device:
            # The engine allocates its cache on the embedding's device: not where an offloaded embedding runs.
            blockers.append(f"the embedding on {self.model.embed_tokens.weight.device.type} (offloaded)")
        return blockers

    def transformers_generate(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        generation_config: GenerationConfig | None,
        config: GenerationConfig,
        seed: int | None,
        num_steps: int | None,
        state_init: str | None,
        kwargs: dict[str, Any],
    ) -> torch.LongTensor | ModelOutput:
        """transformers' generate through ``forward``; sampling from ``seed`` when given (the caller's generator)."""
        if config.get_generation_mode(kwargs.get("assistant_model")) == GenerationMode.ASSISTED_GENERATION:
            # Assisted decoding verifies drafts in a cache it crops: it needs one before the first forward.
            depth = sum(self.resolve_depth(num_steps))
            prompt = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
            if prompt is None:
                raise ValueError("assisted decoding needs input_ids or inputs_embeds: its cache is sized from them")
            kwargs = {CACHE_FIELD: self.new_cache(prompt, depth), **kwargs}
        devices = [input_ids.device] if input_ids is not None and input_ids.device.type == "cuda" else []
        generation_logger = logging.getLogger(GenerationMixin.__module__)  # transformers.generation.utils
        generation_logger.addFilter(drop_right_padding_warning)  # generate gave it already
        try:
            with torch.random.fork_rng(devices=devices, enabled=seed is not None):
                if seed is not None:
                    torch.manual_seed(seed)
                return super().generate(
                    input_ids,
                    attention_mask=attention_mask,
                    generation_config=generation_config,
                    num_steps=num_steps,
                    state_init=state_init,
                    **kwargs,
                )
        finally:
            generation_logger.removeFilter(drop_right_padding_warning)

    def new_cache(self, tokens: torch.Tensor, num_steps: int) -> KVCache:
        """A cache sized for ``tokens`` (B, T[, d]) on their device: where the model runs, also when accelerate
        offloads the embedding (its weight is then a placeholder on "meta"); the embedding's dtype."""
        a = self.model.args
        return TransformersKVCache(
            batch_size=tokens.shape[0],
            capacity=tokens.shape[1],
            n_prelude=a.n_prelude,
            n_core=a.n_core,
            n_coda=a.n_coda,
            n_kv_heads=a.n_kv_heads,
            head_dim=a.head_dim,
            num_steps=num_steps,
            dtype=self.model.embed_tokens.weight.dtype,
            device=tokens.device,
        )


def check_length(columns: int, attention_mask: torch.Tensor | None, args: ModelArgs) -> None:
    """Refuse a row longer than max_seq_len (its real tokens, cached and new), as titan_recur's train, eval and
    generate do: conversion caps it at a sliding-window source's window, past which the source attends to fewer
    tokens than titan_recur's full attention."""
    if columns <= args.max_seq_len:  # the common case, without reading the mask (a device sync)
        return
    length = columns if attention_mask is None else int(attention_mask.sum(-1).max())
    if length > args.max_seq_len:
        raise ValueError(
            f"{length} tokens exceed the model's max_seq_len {args.max_seq_len} (config.max_position_embeddings: "
            "its source's positions, or its sliding attention window, past which the source attends otherwise)"
        )


def is_right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether a row has a 0 after a 1: its new tokens would follow the padding, not its text."""
    mask = attention_mask.long()
    return bool((mask.cummax(dim=1).values > mask).any())


def drop_right_padding_warning(record: logging.LogRecord) -> bool:
    """A logging filter: False for transformers' right-padding warning (generate gives its own, once)."""
    return record.getMessage() != RIGHT_PADDING_WARNING


def saved_card(card: str, source: Path) -> str:
    """The card of ``source`` with a notice after its front matter (the Hub's YAML), replacing an earlier one."""
    front, body = cast(re.Match, re.match(r"(---\n.*?\n---\n)?(.*)", card, re.S)).groups()
    if body.startswith(SAVED_NOTICE):
        body = body.split("\n\n", 1)[-1]
    notice = (
        f"{SAVED_NOTICE} from the model loaded from `{source}`. Training after that load (Trainer, PEFT, ...) is not "
        "described here: the sections below describe that model.\n\n"
    )
    return (front or "") + notice + body


def write_manifest(folder: Path) -> None:
    """manifest.json of the folder's files (titan_recur's format, kind hf_export); none without xxhash."""
    try:
        import xxhash
    except ImportError:
        logger.warning(f"{folder}: xxhash is not installed: no {MANIFEST_NAME} written (pip install xxhash)")
        return
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
    files = {
        name: {"bytes": (folder / name).stat().st_size, CHECKSUM: _xxh3_128(folder / name, xxhash)} for name in names
    }
    manifest = {"kind": "hf_export", "checksum": CHECKSUM, "files": files}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")


def verify_manifest(folder: Path) -> bool:
    """Check the files manifest.json lists (size, then xxh3-128); True when all were checksummed."""
    path = folder / MANIFEST_NAME
    if not path.is_file():
        logger.warning(f"{folder}: no {MANIFEST_NAME}: its files are loaded unverified")
        return False
    files = json.loads(path.read_text())["files"]
    try:
        import xxhash
    except ImportError:
        xxhash = None  # type: ignore[assignment]
        logger.warning(f"{folder}: xxhash is not installed: only file sizes are checked (pip install xxhash)")
    for name, entry in files.items():
        file = folder / name
        if not file.is_file() or file.stat().st_size != entry["bytes"]:
            raise ValueError(
                f"{file}: missing or not the size {MANIFEST_NAME} records (truncated or corrupt); "
                "verify_checksums=False loads it anyway"
            )
        if xxhash is not None and _xxh3_128(file, xxhash) != entry[CHECKSUM]:
            raise ValueError(
                f"{file}: checksum mismatch with {MANIFEST_NAME} (corrupt file); verify_checksums=False loads it anyway"
            )
    return xxhash is not None


def _xxh3_128(path: Path, xxhash: Any) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class TransformersKVCache(KVCache):
    """titan_recur's KVCache with what transformers' generate asks of a cache beyond it (assisted decoding)."""

    is_croppable = True
    is_compileable = False  # transformers' generate compiles the forward of static caches only
    is_linear = [False]  # per layer (transformers 5): attention K/V only, no recurrent (Mamba-like) state

    def activate_past_recording(self) -> None:
        """transformers 5 calls it before verifying drafts; every written column stays until ``crop``."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns cached (every layer holds the same): assisted decoding crops the assistant's cache to its input."""
        return self.length

    def crop(self, max_length: int) -> None:
        """Drop rejected drafts: transformers 5 passes -(columns to drop), 0 dropping none; 4.x the columns to keep."""
        if max_length:
            super().crop(max_length)


@dataclass
class TitanRecurGenerateOutput(GenerateDecoderOnlyOutput):
    """transformers' decoder-only generate output, plus ``steps`` (B, N): the core iterations each new token ran
    (below num_steps where it exited early; 0 after its row finished). With draft_steps, per row (B,): the
    drafted tokens proposed and accepted, and the core iterations drafts and verifications ran in all."""

    steps: torch.Tensor | None = None
    draft_proposed: torch.Tensor | None = None
    draft_accepted: torch.Tensor | None = None
    core_iterations: torch.Tensor | None = None


def default_generation_config() -> GenerationConfig:
    """transformers' generation defaults (5.x keeps unset fields None and fills these in at generate time)."""
    config = GenerationConfig()
    if hasattr(config, "_get_default_generation_params"):
        config.update(**config._get_default_generation_params(), defaults_only=True)
    return config


# Generation config fields the engine serves; any other field away from transformers' default asks for a
# transformers strategy.
ENGINE_CONFIG_FIELDS = {
    "max_length",
    "max_new_tokens",
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "num_beams",
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
    "use_cache",
    "return_dict_in_generate",
    "output_logits",
    "transformers_version",
}
# Inputs the engine path accepts and ignores: transformers 4.x tokenizers return token_type_ids.
IGNORED_INPUTS = {"token_type_ids"}
