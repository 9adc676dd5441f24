"""The random-init model the benchmarks measure, from one set of shape flags: the benchmarks' one way to build it."""

from __future__ import annotations

import argparse
from typing import Any


def add_shape_arguments(parser: argparse.ArgumentParser, *, vocab: int = 512, shape: str = "1,2,1") -> None:
    """--dim --heads --kv-heads --ffn --vocab --shape (head_dim = dim / heads)."""
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=vocab)
    parser.add_argument("--shape", default=shape, help="P,R,C")


def shape_model_args(args: argparse.Namespace, **overrides: Any):
    """The ``ModelArgs`` of the shape flags: a random adapter (so that depth matters) and a zero initial state."""
    from titan_recur.convert.surgery import parse_shape
    from titan_recur.models.args import ModelArgs

    prelude, core, coda = parse_shape(args.shape)
    values = dict(
        vocab_size=args.vocab,
        dim=args.dim,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        head_dim=args.dim // args.heads,
        ffn_dim=args.ffn,
        n_prelude=prelude,
        n_core=core,
        n_coda=coda,
        adapter_init="random",
        state_init="zero",
    )
    return ModelArgs(**{**values, **overrides})


def random_model(model_args, seed: int = 0):
    """``RecurrentLM(model_args)`` with ``init_weights()`` after ``torch.manual_seed(seed)``, on the CPU in fp32."""
    import torch

    from titan_recur.models.model import RecurrentLM

    torch.manual_seed(seed)
    model = RecurrentLM(model_args)
    model.init_weights()
    return model
