"""Write an HF model folder (safetensors, tokenizer, chat template) from a GGUF file, through transformers.

    python tools/gguf_to_hf.py FOLDER/model.gguf OUT

transformers reads the GGUF (its own loader: ``from_pretrained(..., gguf_file=...)``, which needs the ``gguf``
package, ``pip install -e '.[gguf]'``) and dequantizes the weights to float32; the model is then re-saved
as a plain checkpoint, without the quantization record that keeps transformers from saving it. tools/fetch_smollm2.sh
runs this on SmolLM2-135M-Instruct; any GGUF architecture transformers loads works the same way.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from titan_recur.cli.kit import OneLineParser

GGUF_EXTRA = "pip install -e '.[gguf]' (or pip install gguf)"


def gguf_available() -> bool:
    """The ``gguf`` package transformers' GGUF loader needs."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        return False
    return True


def export(gguf_file: Path, out: Path) -> None:
    """Dequantize ``gguf_file`` with transformers and save it under ``out`` as an ordinary HF checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)  # the record that makes save_pretrained refuse
    settings.pop("_name_or_path", None)
    config = type(loaded.config).from_dict(settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="gguf_to_hf.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    parser.add_argument("out", type=Path, help="output folder (must not exist or be empty)")
    args = parser.parse_args(argv)
    if not args.gguf.is_file():
        parser.error(f"{args.gguf}: no such file")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} exists and is not empty")
    if not gguf_available():
        parser.error(f"transformers' GGUF loader needs the gguf package: {GGUF_EXTRA}")
    export(args.gguf, args.out)
    print(f"wrote {args.out} (from {args.gguf}, dequantized to float32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
