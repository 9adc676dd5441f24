"""Build the tiny offline assets that tests and the CPU demo use; deterministic and re-runnable.

    python tools/make_tiny_assets.py [--out assets] [--steps 300]

Writes under OUT:
  corpus/general.jsonl  English prose from the documentation that ships with Python
                        (pydoc language-reference topics + stdlib docstrings), {"text": ...} per line
  corpus/math.jsonl     templated word problems with worked answers, GSM8K style ("#### 42")
  tokenizer/            byte-level BPE (HF tokenizer.json), vocab 512, trained on both corpora
  tiny_llama/           LlamaForCausalLM (d 64, 8 layers, 4 heads / 2 kv heads, ffn 128, untied),
                        briefly pretrained on the corpus so a retrofit starts from a model that knows something
  tiny_olmo2/           Olmo2ForCausalLM (d 64, 6 layers, 4 heads MHA, ffn 128), pretrained the same way
  tiny_llama_recurrent/ tiny_llama converted with shape 1,2,1 (identity adapter; layers 1-4 dropped): the CPU demo's model

Nothing is downloaded. The general corpus depends on the Python version's docs, so rebuild assets
with the same Python to reproduce them byte for byte.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import pydoc_data.topics
import random
import re
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from titan_recur.convert.surgery import convert, plan_layers

SEED = 1234
VOCAB_SIZE = 512
PAD, BOS, EOS = "<|pad|>", "<|begin_of_text|>", "<|end_of_text|>"
GENERAL_BYTES = 1_000_000
MATH_BYTES = 500_000
SEQ_LEN = 128
BATCH_SIZE = 16
EVAL_ROWS = 64

# Stdlib modules with substantial docstrings and no import side effects.
DOC_MODULES = (
    "abc argparse ast asyncio base64 bdb binascii bisect builtins bz2 calendar cmath cmd code codecs codeop "
    "collections collections.abc colorsys compileall concurrent.futures configparser contextlib contextvars copy "
    "copyreg csv dataclasses datetime decimal difflib dis doctest email enum errno faulthandler filecmp fileinput "
    "fnmatch fractions ftplib functools gc getopt getpass gettext glob graphlib gzip hashlib heapq hmac "
    "html.parser http.client http.cookiejar http.cookies http.server imaplib importlib importlib.metadata "
    "importlib.resources inspect io ipaddress itertools json keyword linecache locale logging logging.handlers "
    "lzma mailbox marshal math mimetypes modulefinder multiprocessing netrc numbers operator optparse os "
    "os.path pathlib pdb pickle pickletools pkgutil platform plistlib poplib posixpath pprint profile pstats "
    "py_compile pyclbr pydoc queue quopri random re reprlib rlcompleter runpy sched secrets selectors shelve "
    "shlex shutil signal site smtplib socket socketserver sqlite3 ssl stat statistics string stringprep struct "
    "subprocess symtable sys sysconfig tabnanny tarfile tempfile textwrap threading time timeit token tokenize "
    "trace traceback tracemalloc types typing unicodedata unittest unittest.mock urllib.parse urllib.request "
    "uuid warnings wave weakref webbrowser wsgiref.handlers xml.dom.minidom xml.etree.ElementTree xml.sax "
    "xmlrpc.client xmlrpc.server zipapp zipfile zipimport zlib zoneinfo"
).split()
DOC_CHARS = 2000  # target document length: paragraphs are grouped up to this many characters


# ---------------------------------------------------------------- general corpus


def _prose_paragraphs(text: str) -> Iterator[str]:
    """Prose paragraphs of a docstring: drop code, grammar productions, tables and reST underlines."""
    for para in re.split(r"\n\s*\n", text):
        lines = [line for line in para.splitlines() if line.strip()]
        if not lines or lines[0].startswith((" ", ">>>")) or re.fullmatch(r"[*=\-+|~^ ]+", lines[-1].strip()):
            continue
        para = " ".join(line.strip() for line in lines)
        letters = sum(c.isalpha() or c == " " for c in para)
        if len(para) >= 40 and letters / len(para) > 0.85:
            yield para


def _own_doc(obj: object) -> str:
    """The object's own docstring, not one inherited from a base class."""
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def _module_docstrings(module_name: str) -> Iterator[str]:
    """Docstrings of a module, its public classes (with their methods) and functions."""
    module = importlib.import_module(module_name)
    yield _own_doc(module)
    for attr in sorted(dir(module)):
        obj = getattr(module, attr, None)
        if attr.startswith("_") or not str(getattr(obj, "__module__", "")).startswith(module_name.split(".")[0]):
            continue
        if inspect.isclass(obj) or callable(obj):
            yield _own_doc(obj)
        if inspect.isclass(obj):
            for name, member in sorted(vars(obj).items()):
                if not name.startswith("_") and callable(member):
                    yield _own_doc(member)


def _source_texts() -> Iterator[str]:
    """Language-reference topics, then one text per stdlib module (all its docstrings joined)."""
    for name in sorted(pydoc_data.topics.topics):
        yield pydoc_data.topics.topics[name]
    for module_name in DOC_MODULES:
        with warnings.catch_warnings():  # deprecated aliases (typing.io, ...) warn when touched
            warnings.simplefilter("ignore", DeprecationWarning)
            text = "\n\n".join(_module_docstrings(module_name))
        yield text


def general_documents(max_chars: int) -> list[str]:
    """Documents of up to ~DOC_CHARS characters of unique prose paragraphs, max_chars in total."""
    docs: list[str] = []
    seen: set[str] = set()
    total = 0
    for text in _source_texts():
        current: list[str] = []
        for para in _prose_paragraphs(text):
            if para in seen:
                continue
            seen.add(para)
            current.append(para)
            if sum(map(len, current)) >= DOC_CHARS:
                docs.append("\n\n".join(current))
                current = []
        if current and sum(map(len, current)) >= 200:
            docs.append("\n\n".join(current))
        total = sum(map(len, docs))
        if total >= max_chars:
            break
    return docs


# ---------------------------------------------------------------- math corpus

NAMES = "Ava Ben Carla Dev Emma Farid Grace Hugo Ines Jamal Kira Leo Maya Noah Olga Pablo Quinn Rosa Sam Tara".split()
ITEMS = "apples pencils stickers marbles cookies books cards shells stamps oranges".split()


def _shopping(rng: random.Random) -> tuple[str, list[str], int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price, paid_extra = rng.randint(2, 12), rng.randint(2, 15), rng.randint(1, 40)
    cost = count * price
    paid = cost + paid_extra
    question = (
        f"{name} buys {count} {item} that cost ${price} each. {name} pays with ${paid}. "
        f"How much change does {name} get?"
    )
    steps = [f"The {item} cost {count} * {price} = ${cost}.", f"The change is {paid} - {cost} = ${paid_extra}."]
    return question, steps, paid_extra


def _percent(rng: random.Random) -> tuple[str, list[str], int]:
    name, item = rng.choice(NAMES), rng.choice(["jacket", "bike", "lamp", "game", "backpack", "watch"])
    price, percent = rng.randint(2, 40) * 10, rng.choice([10, 20, 25, 30, 40, 50])
    discount = price * percent // 100
    final = price - discount
    question = f"A {item} costs ${price}. {name} gets a {percent}% discount. How much does {name} pay?"
    steps = [
        f"The discount is {percent}% of {price} = {price} * {percent} / 100 = ${discount}.",
        f"{name} pays {price} - {discount} = ${final}.",
    ]
    return question, steps, final


def _rate(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    speed, hours, extra = rng.randint(3, 60), rng.randint(2, 9), rng.randint(1, 30)
    first = speed * hours
    total = first + extra
    question = (
        f"{name} travels at {speed} km per hour for {hours} hours, then walks another {extra} km. "
        f"How many kilometers does {name} cover in total?"
    )
    steps = [
        f"At {speed} km per hour for {hours} hours, {name} covers {speed} * {hours} = {first} km.",
        f"In total {name} covers {first} + {extra} = {total} km.",
    ]
    return question, steps, total


def _work(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    per_hour, hours, days = rng.randint(2, 20), rng.randint(2, 8), rng.randint(2, 7)
    per_day = per_hour * hours
    total = per_day * days
    question = (
        f"{name} packs {per_hour} boxes every hour and works {hours} hours a day. "
        f"How many boxes does {name} pack in {days} days?"
    )
    steps = [
        f"Each day {name} packs {per_hour} * {hours} = {per_day} boxes.",
        f"In {days} days {name} packs {per_day} * {days} = {total} boxes.",
    ]
    return question, steps, total


def _sharing(rng: random.Random) -> tuple[str, list[str], int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each, kept, bags = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 20), rng.randint(2, 6)
    given = friends * each
    total = given + kept
    per_bag_total = total * bags
    question = (
        f"{name} gives {each} {item} to each of {friends} friends and keeps {kept} {item}. "
        f"{name}'s cousin has {bags} times as many {item} as {name} had at the start. "
        f"How many {item} does the cousin have?"
    )
    steps = [
        f"{name} gives away {friends} * {each} = {given} {item}.",
        f"{name} started with {given} + {kept} = {total} {item}.",
        f"The cousin has {bags} * {total} = {per_bag_total} {item}.",
    ]
    return question, steps, per_bag_total


def _arithmetic(rng: random.Random) -> tuple[str, list[str], int]:
    a, b, c = rng.randint(10, 999), rng.randint(10, 999), rng.randint(2, 19)
    total = (a + b) * c
    question = f"What is ({a} + {b}) * {c}?"
    steps = [f"First, {a} + {b} = {a + b}.", f"Then {a + b} * {c} = {total}."]
    return question, steps, total


MATH_TEMPLATES: tuple[Callable[[random.Random], tuple[str, list[str], int]], ...] = (
    _shopping,
    _percent,
    _rate,
    _work,
    _sharing,
    _arithmetic,
)


def math_documents(max_bytes: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    docs, total = [], 0
    while total < max_bytes:
        question, steps, answer = rng.choice(MATH_TEMPLATES)(rng)
        docs.append(f"Question: {question}\nAnswer: {' '.join(steps)}\n#### {answer}")
        total += len(docs[-1])
    return docs


def write_jsonl(docs: list[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(docs: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2/Llama-3 style) that prepends BOS like Llama-3's tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=2048
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    """save_pretrained, with the class name older transformers also load (as in Llama-3 checkpoints)."""
    tokenizer.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("backend", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------- tiny models


def token_rows(tokenizer: PreTrainedTokenizerFast, docs: list[str], seq_len: int, seed: int) -> torch.Tensor:
    """Documents (BOS ... EOS) concatenated and cut into shuffled rows of seq_len + 1 tokens."""
    stream: list[int] = []
    for ids in tokenizer(docs)["input_ids"]:
        stream.extend(ids + [tokenizer.eos_token_id])
    n_rows = len(stream) // (seq_len + 1)
    rows = torch.tensor(stream[: n_rows * (seq_len + 1)]).view(n_rows, seq_len + 1)
    return rows[torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed))]


def next_token_loss(model: PreTrainedModel, rows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=rows[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())


@torch.no_grad()
def eval_loss(model: PreTrainedModel, rows: torch.Tensor) -> float:
    model.eval()
    return sum(next_token_loss(model, batch).item() for batch in rows.split(BATCH_SIZE)) / math.ceil(
        len(rows) / BATCH_SIZE
    )


def pretrain(model: PreTrainedModel, train_rows: torch.Tensor, eval_rows: torch.Tensor, steps: int) -> None:
    """AdamW with linear warmup and cosine decay; prints held-out loss before and after."""
    name = type(model).__name__
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {n_params:,} params, eval loss before {eval_loss(model, eval_rows):.3f}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(steps // 20, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min((s + 1) / warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * min(s / steps, 1.0)))),
    )
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        batch = train_rows[(step * BATCH_SIZE) % (len(train_rows) - BATCH_SIZE) :][:BATCH_SIZE]
        loss = next_token_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"  step {step:4d}  train loss {loss.item():.3f}")
    seconds = time.perf_counter() - start
    print(f"{name}: eval loss after {steps} steps {eval_loss(model, eval_rows):.3f} ({seconds:.0f} s)")


def tiny_llama_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **_special_ids(tokenizer),
    )


def tiny_olmo2_config(tokenizer: PreTrainedTokenizerFast) -> Olmo2Config:
    return Olmo2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **_special_ids(tokenizer),
    )


def _special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    return dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )


def build_model(
    model_cls: type[PreTrainedModel], config: LlamaConfig | Olmo2Config, rows: torch.Tensor, steps: int
) -> PreTrainedModel:
    torch.manual_seed(SEED)
    model = model_cls(config)
    eval_rows, train_rows = rows[:EVAL_ROWS], rows[EVAL_ROWS:]
    pretrain(model, train_rows, eval_rows, steps)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("assets"), help="output folder (default: assets)")
    parser.add_argument("--steps", type=int, default=300, help="pretraining steps per tiny model (default: 300)")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # thread count changes CPU reduction order; one thread reproduces the weights

    general, maths = general_documents(GENERAL_BYTES), math_documents(MATH_BYTES, SEED)
    write_jsonl(general, args.out / "corpus" / "general.jsonl")
    write_jsonl(maths, args.out / "corpus" / "math.jsonl")
    print(f"corpus: {len(general)} general documents, {len(maths)} math problems")

    docs = general + maths
    random.Random(SEED).shuffle(docs)
    tokenizer = train_tokenizer(docs, VOCAB_SIZE)
    save_tokenizer(tokenizer, args.out / "tokenizer")
    rows = token_rows(tokenizer, docs, SEQ_LEN, SEED)
    print(f"tokenizer: vocab {len(tokenizer)}; {rows.numel():,} tokens in {len(rows)} rows of {SEQ_LEN + 1}")

    for folder, model_cls, config in (
        ("tiny_llama", LlamaForCausalLM, tiny_llama_config(tokenizer)),
        ("tiny_olmo2", Olmo2ForCausalLM, tiny_olmo2_config(tokenizer)),
    ):
        model = build_model(model_cls, config, rows, args.steps)
        model.save_pretrained(args.out / folder)
        save_tokenizer(tokenizer, args.out / folder)
    # The CPU demo's starting point (train_configs/debug_model.toml): tiny_llama retrofitted to (2, 4, 2).
    convert(args.out / "tiny_llama", args.out / "tiny_llama_recurrent", plan_layers(8, (1, 2, 1)), force=True)


if __name__ == "__main__":
    main()
