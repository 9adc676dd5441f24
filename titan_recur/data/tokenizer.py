"""Three tokenizer backends behind one interface, picked from the files in a model folder.

- ``tokenizer.json``: Hugging Face ``tokenizers`` (OLMo-2; also what HF exports of Llama ship),
  with BOS/EOS taken from ``tokenizer_config.json``.
- ``tokenizer.model`` holding ``base64-token rank`` lines: Meta's Llama-3 tiktoken format.
- ``tokenizer.model`` holding a sentencepiece protobuf: TinyLlama / Llama-2.

Documents are packed as ``[BOS] + text + [EOS]`` with the BOS only where the source model's own
tokenizer adds one (``Tokenizer.add_bos``), so training data looks like the model's pretraining data.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

HF_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
MODEL_FILE = "tokenizer.model"

# Meta's Llama-3 tokenizer (llama-models, Llama 3.1+ layout): pattern and 256 special tokens.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL = 256
LLAMA3_NAMED_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
# tiktoken's regex recurses per character: Meta splits long texts and long runs to avoid stack overflows.
_TIKTOKEN_MAX_CHARS = 400_000
_TIKTOKEN_MAX_RUN = 25_000
# Whole runs, matched only where a run starts (the lookbehind), so the scan stays linear.
_TIKTOKEN_LONG_RUN = re.compile(rf"(?<!\S)\S{{{_TIKTOKEN_MAX_RUN},}}|(?<!\s)\s{{{_TIKTOKEN_MAX_RUN},}}")
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=* \d+$")


class Tokenizer(ABC):
    """encode/decode plus the special ids the packer and the model config need."""

    vocab_size: int  # one more than the largest id the tokenizer can produce
    bos_id: int | None
    eos_id: int
    pad_id: int | None
    add_bos: bool  # whether the source model's tokenizer starts a document with BOS

    @abstractmethod
    def _encode(self, text: str) -> list[int]:
        """Ids of plain text; special-token strings in the text are encoded as ordinary text."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of ids, special tokens included."""

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        """Ids of ``text``, optionally wrapped in BOS / EOS."""
        ids = self._encode(text)
        if bos:
            if self.bos_id is None:
                raise ValueError(f"{type(self).__name__} has no BOS token")
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id}, add_bos={self.add_bos})"
        )


def _token_content(token: str | dict | None) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    return token.get("content") if isinstance(token, dict) else token


class HFTokenizer(Tokenizer):
    """``tokenizers.Tokenizer`` from tokenizer.json; specials from tokenizer_config.json."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as _HFTokenizer

        self.tok = _HFTokenizer.from_file(str(folder / HF_FILE))
        config_path = folder / HF_CONFIG_FILE
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.bos_id = self._token_id(config.get("bos_token"))
        eos_id = self._token_id(config.get("eos_token"))
        if eos_id is None:
            raise ValueError(f"{folder}: {HF_CONFIG_FILE} names no eos_token known to {HF_FILE}")
        self.eos_id = eos_id
        self.pad_id = self._token_id(config.get("pad_token"))
        self.vocab_size = max(self.tok.get_vocab(with_added_tokens=True).values()) + 1
        if "add_bos_token" in config:
            self.add_bos = bool(config["add_bos_token"]) and self.bos_id is not None
        else:  # no explicit setting: do what the tokenizer's own post-processor does
            self.add_bos = self.bos_id is not None and self.tok.encode("a").ids[:1] == [self.bos_id]

    def _token_id(self, token: str | dict | None) -> int | None:
        content = _token_content(token)
        return None if content is None else self.tok.token_to_id(content)

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def _split_runs(text: str) -> Iterator[str]:
    """Cut ``text`` so that no piece holds more than _TIKTOKEN_MAX_RUN consecutive (non-)whitespace chars."""
    start = 0
    for run in _TIKTOKEN_LONG_RUN.finditer(text):
        yield text[start : run.start()]
        for i in range(run.start(), run.end(), _TIKTOKEN_MAX_RUN):
            yield text[i : min(i + _TIKTOKEN_MAX_RUN, run.end())]
        start = run.end()
    yield text[start:]


class TiktokenTokenizer(Tokenizer):
    """Meta's Llama-3 ``tokenizer.model`` (base64 token + rank per line) with Llama-3 special tokens."""

    def __init__(self, path: Path):
        import tiktoken

        ranks = {}
        for line in path.read_bytes().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        n_base = len(ranks)
        names = LLAMA3_NAMED_SPECIAL + [
            f"<|reserved_special_token_{i}|>" for i in range(2, 2 + LLAMA3_NUM_SPECIAL - len(LLAMA3_NAMED_SPECIAL))
        ]
        self.special_tokens = {name: n_base + i for i, name in enumerate(names)}
        self.enc = tiktoken.Encoding(
            name=path.parent.name or "llama3",
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.vocab_size = self.enc.n_vocab
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self.pad_id = None
        self.add_bos = True

    def _encode(self, text: str) -> list[int]:
        if len(text) <= _TIKTOKEN_MAX_RUN:
            return self.enc.encode_ordinary(text)
        ids = []
        for i in range(0, len(text), _TIKTOKEN_MAX_CHARS):
            for piece in _split_runs(text[i : i + _TIKTOKEN_MAX_CHARS]):
                ids += self.enc.encode_ordinary(piece)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece ``tokenizer.model`` (TinyLlama: BOS 1 ``<s>``, EOS 2 ``</s>``, BOS added)."""

    def __init__(self, path: Path):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self.sp.vocab_size()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        if self.sp.eos_id() < 0:
            raise ValueError(f"{path}: the sentencepiece model has no EOS token")
        self.eos_id = self.sp.eos_id()
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else None
        self.add_bos = self.bos_id is not None

    def _encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)


def _is_tiktoken_file(path: Path) -> bool:
    with path.open("rb") as f:
        return bool(_TIKTOKEN_LINE.match(f.readline().rstrip(b"\r\n")))


def load_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer of a model folder: tokenizer.json first, else tokenizer.model (tiktoken or sentencepiece).

    Files that do not parse are one ValueError naming the folder: the tokenizers and sentencepiece libraries
    raise bare Exception and RuntimeError in their own words."""
    folder = Path(folder)
    try:
        return _open_tokenizer(folder)
    except FileNotFoundError:
        raise
    except Exception as err:
        cause = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(f"{folder}: its tokenizer files do not load ({type(err).__name__}: {cause})") from None


def _open_tokenizer(folder: Path) -> Tokenizer:
    if (folder / HF_FILE).is_file():
        return HFTokenizer(folder)
    model = folder / MODEL_FILE
    if model.is_file():
        return TiktokenTokenizer(model) if _is_tiktoken_file(model) else SentencePieceTokenizer(model)
    raise FileNotFoundError(
        f"{folder}: no tokenizer found (expected {HF_FILE} [+ {HF_CONFIG_FILE}], or {MODEL_FILE} "
        "in Llama-3 tiktoken or sentencepiece format)"
    )


_TOKENIZER_PROBE = (
    "The quick brown fox jumps over the lazy dog.\n3 + 4 = 7; x^2 - 1 = (x - 1)(x + 1).  Gr\u00fc\u00dfe!"
)


def tokenizer_probe(tokenizer: Tokenizer) -> str:
    """A digest of what ids mean: the ids of a fixed text with BOS/EOS, and the vocabulary size (the same for
    the same vocabulary in any file format: tokenizer.json or a tiktoken/sentencepiece model)."""
    ids = tokenizer.encode(_TOKENIZER_PROBE, bos=tokenizer.bos_id is not None, eos=True)
    return hashlib.sha256(json.dumps([ids, tokenizer.vocab_size]).encode()).hexdigest()[:16]


def check_same_tokenizer(tokenizer: Tokenizer, given: str | Path, own: Path, flag: str) -> None:
    """A tokenizer named beside a model folder that holds its own must mean the same ids (the same probe digest):
    a tokenizer of another vocabulary whose ids happen to fit the embedding would run and be silently wrong."""
    has_own = (own / HF_FILE).is_file() or (own / MODEL_FILE).is_file()
    if not has_own or Path(given).resolve() == own.resolve():
        return
    theirs = load_tokenizer(own)
    if tokenizer_probe(tokenizer) != tokenizer_probe(theirs):
        raise ValueError(
            f"{flag} {given} is not the tokenizer of {own} (its ids mean other tokens: vocab {tokenizer.vocab_size} "
            f"vs {theirs.vocab_size}); drop {flag} to use the model's own"
        )


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Refuse a tokenizer whose ids can reach past the model's embedding (a larger, padded model vocab is fine)."""
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(
            f"tokenizer/model vocab mismatch: the tokenizer produces ids up to {tokenizer.vocab_size - 1} "
            f"but the model's vocab_size is {model_vocab_size}"
        )
