"""lm-eval-harness model ``titan_recur``: a titan_recur checkpoint at a chosen test recurrence.

Registered on import (lm_eval 0.4.13 has no plugin discovery), so use it through
``python -m titan_recur.eval harness`` or, in Python, ``import titan_recur.eval.lm_eval_model`` before
``lm_eval.simple_evaluate(model="titan_recur", model_args="pretrained=PATH,num_steps=32")``.

Batches are exact: loglikelihood rows are right-padded (causal attention never sees the padding),
generation rows left-padded with an attention mask and mask-derived positions, and the recurrent
state starts deterministic (see ``ModelArgs.eval_state_init``), so batch size changes nothing but speed.
Generation runs titan_recur's engine (docs/generation.md), with its KV sharing and per-token adaptive
exit; batched adaptive exit gives every request what it gets alone.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, get_args, get_type_hints

import torch
import torch.nn.functional as F
from lm_eval import utils
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from titan_recur.data.tokenizer import check_vocab, load_tokenizer
from titan_recur.eval.loading import default_tokenizer_folder, load_checkpoint, resolve_device
from titan_recur.inference.engine import GenerationOutput, generate, left_pad
from titan_recur.inference.options import GenerationOptions, ResolvedOptions
from titan_recur.models.args import WARM_START
from titan_recur.utils.limits import check_recurrences

# GenerationOptions fields that are not model_args: each request gives the token budget (max_gen_toks) and
# the tokenizer the EOS id; lm-eval's tasks decide greedy or sampled decoding, and titan_recur decodes
# greedily (``_generation_settings``). Every other field is a model_arg, converted to the field's type.
NOT_MODEL_ARGS = ("max_new_tokens", "eos_id", "generator", "temperature", "top_p", "top_k", "seed")
GENERATION_MODEL_ARGS = tuple(f.name for f in dataclasses.fields(GenerationOptions) if f.name not in NOT_MODEL_ARGS)


@register_model("titan_recur")
class TitanRecurLM(TemplateLM):
    """model_args: pretrained=PATH (model folder or DCP step + model_config=FOLDER), batch_size, device, dtype
    (float32|bfloat16), max_length, max_gen_toks, tokenizer=FOLDER (default: the model folder);
    unverified=true loads a model folder that has no manifest (storage/model_io.py); and every field of
    ``GenerationOptions`` in ``GENERATION_MODEL_ARGS``, with its meaning and default there (KV sharing,
    adaptive exit, the fast path, speculative decoding: docs/generation.md). Two of them also set scoring:
    num_steps=r (default: the model's mean_recurrence) and state_init (default: deterministic, see
    ModelArgs.eval_state_init; "previous" warm-starts generated tokens, scoring starts from the init).

    ``num_steps`` and ``exit_threshold`` may be changed between evaluations of the same instance (the
    harness sweep does). ``depth_stats`` accumulates, per task, generated tokens and the core iterations
    they ran, the drafts and verifications of speculative decoding included (``reset_depth_stats`` clears it).
    """

    def __init__(
        self,
        pretrained: str,
        *,
        batch_size: int | str = 1,
        device: str | None = "auto",
        dtype: str = "float32",
        max_length: int | None = None,
        max_gen_toks: int = 256,
        model_config: str | None = None,
        tokenizer: str | None = None,
        unverified: bool = False,
        **generation: Any,
    ) -> None:
        unknown = [name for name in generation if name not in GENERATION_MODEL_ARGS]
        if unknown:  # as Python words it for a keyword the signature lacks
            raise TypeError(f"TitanRecurLM.__init__() got an unexpected keyword argument {unknown[0]!r}")
        super().__init__()
        if str(batch_size).startswith("auto"):
            raise ValueError("titan_recur: batch_size=auto is not supported; give a number")
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"titan_recur: batch_size must be >= 1, got {batch_size}")
        self._device = resolve_device(device)
        self.model = load_checkpoint(
            pretrained, model_config, device=self._device, dtype=dtype, unverified=bool(unverified)
        )
        self.tokenizer = load_tokenizer(tokenizer or default_tokenizer_folder(pretrained, model_config))
        check_vocab(self.tokenizer, self.model.args.vocab_size)
        options = GenerationOptions.from_values(generation_values(generation))
        # Scoring starts every position from the init; "previous" only applies to generated tokens.
        state_init = options.state_init
        self.state_init = self.model.args.eval_state_init if state_init in (None, WARM_START) else state_init
        self.max_length = int(max_length or self.model.args.max_seq_len)
        self.max_gen_toks = int(max_gen_toks)
        # The depth lives in num_steps (which a sweep changes); generation_options puts it in.
        self.generation = dataclasses.replace(options, num_steps=None)
        self.num_steps = self.model.args.mean_recurrence if options.num_steps is None else options.num_steps
        self.depth_stats: dict[str, list[int]] = {}

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> TitanRecurLM:
        """How lm_eval builds the model (``--model_args`` plus its own ``--device``, ``--batch_size``)."""
        return cls.create_from_arg_obj(utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> TitanRecurLM:
        """The model args and lm_eval's settings; a device in the model args wins over lm_eval's.

        lm_eval passes its default device cuda:0 when none is asked for: where CUDA does not exist the
        model runs on the CPU, with a warning, as lm_eval's own HF backend does.
        """
        settings = {k: v for k, v in (additional_config or {}).items() if v is not None}
        device = settings.pop("device", None)
        if device is not None and "device" not in arg_dict:
            if str(device).startswith("cuda") and not torch.cuda.is_available():
                logging.getLogger(__name__).warning("titan_recur: no CUDA here, so device %s becomes cpu", device)
                device = "cpu"
            arg_dict = {**arg_dict, "device": device}
        return cls(**arg_dict, **settings)

    @property
    def num_steps(self) -> int:
        return self._num_steps

    @num_steps.setter
    def num_steps(self, value: int) -> None:
        self._num_steps = check_recurrences([value], "num_steps")[0]
        self.generation_options(1)  # every knob checked against this depth now, not mid-evaluation

    @property
    def exit_threshold(self) -> float | None:
        return self.generation.exit_threshold

    @exit_threshold.setter
    def exit_threshold(self, value: float | None) -> None:
        self.generation = dataclasses.replace(self.generation, exit_threshold=value)
        self.generation_options(1)

    def generation_options(self, max_new_tokens: int) -> ResolvedOptions:
        """The engine's options at the current depth (one-line ValueError for a bad knob)."""
        options = dataclasses.replace(
            self.generation, max_new_tokens=max_new_tokens, num_steps=self.num_steps, eos_id=self.eot_token_id
        )
        try:
            return options.resolve(self.model.args)
        except ValueError as err:
            raise ValueError(f"titan_recur: {err}") from None

    def reset_depth_stats(self) -> None:
        self.depth_stats = {}

    def mean_iterations(self, task: str) -> float:
        """Mean core iterations per generated token of ``task`` (r where it generated nothing: scoring runs r)."""
        tokens, iterations = self.depth_stats.get(task, (0, 0))
        return iterations / tokens if tokens else float(self.num_steps)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What rolling windows and empty contexts are conditioned on: EOS, which precedes every document
        in a packed training row (the document itself starts with BOS where the tokenizer adds one)."""
        return self.tokenizer.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Ids of ``string``, starting with BOS where the tokenizer adds one, unless add_special_tokens=False."""
        return self.tokenizer.encode(string, bos=self.tokenizer.add_bos and add_special_tokens is not False, eos=False)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        with torch.no_grad():
            return self.model(input_ids, self.num_steps, attention_mask=attention_mask, state_init=self.state_init)

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(sum of continuation log-probs, whether greedy decoding reproduces it) per (key, context, continuation)."""

        def length_first(request: tuple[Any, list[int], list[int]]) -> tuple[int, tuple[int, ...]]:
            tokens = request[1] + request[2]
            return -len(tokens), tuple(tokens)

        ordered = Collator(requests, sort_fn=length_first)
        results = []
        for batch in ordered.get_batched(n=self.batch_size):
            # The last max_length + 1 tokens; the model reads all but the last and predicts all but the first.
            rows = [(request[1] + request[2])[-(self.max_length + 1) :] for request in batch]
            inputs = [row[:-1] for row in rows]
            input_ids = _pad(inputs, self.tokenizer.pad_id or 0, left=False).to(self._device)
            logprobs = F.log_softmax(self._forward(input_ids).float(), dim=-1)
            for i, (request, row) in enumerate(zip(batch, rows, strict=True)):
                n_cont = len(request[2])
                target = torch.tensor(row[-n_cont:], device=self._device)
                scores = logprobs[i, len(row) - 1 - n_cont : len(row) - 1]
                result = (float(scores.gather(-1, target[:, None]).sum()), bool((scores.argmax(-1) == target).all()))
                if request[0] is not None:
                    self.cache_hook.add_partial("loglikelihood", request[0], result)
                results.append(result)
        return ordered.get_original(results)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts as packed in training ([BOS] text where the tokenizer adds BOS), after EOS,
        in max_length windows that each predict new tokens only."""
        windows, owners = [], []
        for i, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            for context, continuation in map(
                utils.make_disjoint_window,
                utils.get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1),
            ):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[i] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop sequence (or EOS), batched by equal generation kwargs."""
        encoded = {request.args[0]: self.tok_encode(request.args[0]) for request in requests}
        ordered = Collator(
            [(*request.args, request.task_name) for request in requests],
            sort_fn=lambda args: (-len(encoded[args[0]]), args[0]),
            group_by="gen_kwargs",
            group_fn=lambda args: args[1],
        )
        results = []
        for batch in ordered.get_batched(n=self.batch_size):
            until, max_gen_toks = self._generation_settings(batch[0][1])
            contexts = [encoded[context][-(self.max_length - max_gen_toks) :] for context, _, _ in batch]
            input_ids, attention_mask = left_pad(contexts, self.tokenizer.pad_id or 0)
            out = generate(
                self.model,
                input_ids.to(self._device),
                self.generation_options(max_gen_toks),
                attention_mask=attention_mask.to(self._device),
                stop=self._stop_check(until),
            )
            spent = iterations_spent(out)
            rows = zip(batch, out.tokens.tolist(), spent, out.lengths.tolist(), strict=True)
            for (context, gen_kwargs, task), tokens, iterations, length in rows:
                stats = self.depth_stats.setdefault(task, [0, 0])
                stats[0], stats[1] = stats[0] + length, stats[1] + iterations
                if self.eot_token_id in tokens:
                    tokens = tokens[: tokens.index(self.eot_token_id)]
                text = postprocess_generated_text(self.tok_decode(tokens), until, None)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                results.append(text)
        return ordered.get_original(results)

    def _stop_check(self, until: list[str]):
        """Rows whose decoded text already holds a stop sequence: decoding ends once every row has one."""

        def stopped(new_tokens: torch.Tensor) -> torch.Tensor:
            texts = [self.tok_decode(row) for row in new_tokens.tolist()]
            return torch.tensor([any(s in text for s in until) for text in texts], device=new_tokens.device)

        return stopped

    def _generation_settings(self, gen_kwargs: dict[str, Any]) -> tuple[list[str], int]:
        """Stop sequences (with the EOS text) and the token budget; only greedy decoding is supported."""
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        if kwargs.get("do_sample"):
            raise ValueError(f"titan_recur decodes greedily; the task asks for sampling ({gen_kwargs})")
        max_gen_toks = kwargs["max_gen_toks"]
        if max_gen_toks >= self.max_length:
            raise ValueError(f"max_gen_toks ({max_gen_toks}) must be below the model's max_length ({self.max_length})")
        return handle_stop_sequences(kwargs["until"], eos=self.tok_decode([self.eot_token_id])), max_gen_toks


def _pad(rows: list[list[int]], value: int, left: bool) -> torch.Tensor:
    width = max(len(row) for row in rows)
    padded = [[value] * (width - len(row)) + row if left else row + [value] * (width - len(row)) for row in rows]
    return torch.tensor(padded, dtype=torch.long)


def iterations_spent(out: GenerationOutput) -> list[int]:
    """Core iterations each row ran for its emitted tokens: per-token steps, or speculation's drafts + verifies."""
    if out.speculation is not None:
        return out.speculation.core_iterations.tolist()
    emitted = torch.arange(out.steps.shape[1], device=out.steps.device)[None, :] < out.lengths[:, None]
    return (out.steps * emitted).sum(dim=1).tolist()


def generation_values(model_args: dict[str, Any]) -> dict[str, Any]:
    """Generation model_args converted to their GenerationOptions field's type (lm-eval parses numbers and
    booleans, Python callers may give strings); None stays None (the field's default)."""
    hints = get_type_hints(GenerationOptions)
    converted = {}
    for name, value in model_args.items():
        kind = next(t for t in (*get_args(hints[name]), hints[name]) if t is not type(None))
        converted[name] = kind(value) if value is not None and kind in (int, float, bool) else value
    return converted
