"""An HF export answers a chat prompt with the engine's tokens: ``from_pretrained(trust_remote_code=True)`` +
``generate`` on the chat template's ids, against titan_recur's own engine on the model it was exported from.

    python tools/check_export_chat.py EXPORT MODEL --num-steps 4 [--prompt TEXT] [--max-new-tokens 24] [--out FILE]

EXPORT: a folder of tools/export_hf.py; MODEL: the titan_recur model folder it came from (a run's
final_model/). The prompt goes through the export's chat template (``apply_chat_template`` with the
generation prompt); both sides decode greedily at ``--num-steps`` iterations. Prints both answers,
writes them as JSON to --out, and exits 1 when the tokens differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from titan_recur.cli.kit import OneLineParser
from titan_recur.eval.loading import load_checkpoint
from titan_recur.inference.engine import greedy_generate


def chat_ids(tokenizer, prompt: str) -> torch.Tensor:
    """(1, T) ids of one user turn and the assistant's generation prompt, as the chat template writes them."""
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return encoded["input_ids"]


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="check_export_chat.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("export", type=Path, help="folder of tools/export_hf.py")
    parser.add_argument("model", type=Path, help="the titan_recur model folder it was exported from")
    parser.add_argument("--num-steps", type=int, required=True, help="core iterations per token")
    parser.add_argument("--prompt", default="What is 12 times 7? Answer with the number.")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, help="write the answers and the verdict here (JSON)")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.export, trust_remote_code=True)
    if not tokenizer.chat_template:
        parser.error(f"{args.export}: the tokenizer has no chat template")
    ids = chat_ids(tokenizer, args.prompt)
    hf = AutoModelForCausalLM.from_pretrained(args.export, trust_remote_code=True).eval()
    with torch.no_grad():
        hf_out = hf.generate(ids, num_steps=args.num_steps, max_new_tokens=args.max_new_tokens, do_sample=False)
    hf_tokens = hf_out[0, ids.shape[1] :].tolist()
    engine = greedy_generate(
        load_checkpoint(args.model), ids, args.max_new_tokens, num_steps=args.num_steps, eos_id=tokenizer.eos_token_id
    )[0].tolist()
    engine_tokens = engine[: len(hf_tokens)]  # the engine pads a finished row with EOS; HF stops at it
    same = hf_tokens == engine_tokens
    report = {
        "prompt": args.prompt,
        "num_steps": args.num_steps,
        "hf_generate": tokenizer.decode(hf_tokens),
        "engine": tokenizer.decode(engine_tokens),
        "same_tokens": same,
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
