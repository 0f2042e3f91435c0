"""Tokenize text files into the token files the language model trains on.

    python -m {{ cookiecutter.package_name }}.tools.prepare TEXT_FILES... --out DIR   # then dataset.dir=DIR
    python -m {{ cookiecutter.package_name }}.tools.prepare TRAIN_FILES... --eval EVAL_FILES... --out DIR
    python -m {{ cookiecutter.package_name }}.tools.prepare TEXT_FILES... --tokenizer tokenizer.json --out DIR
    python -m {{ cookiecutter.package_name }}.tools.prepare --out DIR                 # the built-in corpus

The files' tokens are concatenated in the order given into DIR/train.bin; DIR/val.bin holds the
tokens of the --eval files, or, without them, the last --eval-share (10%) of the files' tokens.
DIR/meta.json records the token dtype, the vocabulary size, the tokenizer, the ids of its
begin-of-text, end-of-text and padding tokens (null where it has none) and the absolute paths of
the sources; training, `sample` and `export` read it. The default tokenizer is byte-level (256 ids, any
file, nothing to download). Another one is either
- a `tokenizer.json` (the Hugging Face `tokenizers` library's file, the huggingface extra): it is
  copied into DIR, so the tokenizer travels with the data, and meta.json names that copy; or
- MODULE:ATTRIBUTE, an object with encode(str) -> list[int], decode(list[int]) -> str and its
  vocabulary size as `n_vocab` or `vocab_size` (tiktoken's encodings have these): e.g. a file
  mytokenizer.py holding `gpt2 = tiktoken.get_encoding("gpt2")`, then `--tokenizer mytokenizer:gpt2`.
Each file is encoded on its own, without the special tokens a tokenizer's post-processor adds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from .. import data
from ..base import extras
from ..base.rules import ConfigError, exit_on_user_error

# what this command writes for: the starter's data.py; after a swap of data.py it says so in one line
STARTER_DATA = ("BYTE_VOCABULARY", "BYTES", "META", "SPLITS", "TOKENIZER_FILE", "built_in_corpus", "tokenizer_name")


def check_starter_data(command: str) -> None:
    missing = [name for name in STARTER_DATA if not hasattr(data, name)]
    if missing:
        raise ConfigError(
            f"{command} works with the language-model starter's data.py (token files, a tokenizer), and yours "
            f"has no {missing[0]}: adapt {command.replace('.', '/')}.py to your data, or delete it"
        )


# how common tokenizer.json files spell their begin-of-text, end-of-text and padding tokens, in the
# order tried (Llama 2 and Mistral, Llama 3, GPT-2 and Qwen, Gemma): Llama 3's chat turn end
# (<|eot_id|>) and Qwen's (<|im_end|>) are not a text's end
SPECIAL_NAMES = {
    "bos": ("<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>"),
    "eos": ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"),
    "pad": ("<pad>", "<|pad|>", "<|padding|>", "[PAD]"),
}


class ByteTokenizer:
    """UTF-8 bytes as tokens: no vocabulary to learn or download; decoding replaces broken characters."""

    @property
    def vocab_size(self) -> int:
        return data.BYTE_VOCABULARY

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


class TokenizerFile:
    """A `tokenizers` library file (tokenizer.json) behind the encode/decode of the other tokenizers."""

    def __init__(self, path: Path):
        tokenizers = extras.require("tokenizers", f"tokenizer {path}")
        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as err:  # the library raises its own exception type for a broken file
            raise ConfigError(f"tokenizer {path}: not a tokenizers file ({err}); pass a tokenizer.json") from None
        self.path = Path(path)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def special_ids(self) -> dict[str, int]:
        """The ids of the file's special tokens that SPECIAL_NAMES spells, by role."""
        special = {token.content: i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.special}
        found = {role: next((special[n] for n in names if n in special), None) for role, names in SPECIAL_NAMES.items()}
        return {role: token_id for role, token_id in found.items() if token_id is not None}


def load_tokenizer(name: str):
    """The tokenizer `name` records: bytes, a tokenizer.json file, or MODULE:ATTRIBUTE."""
    if name == data.BYTES:
        return ByteTokenizer()
    if name.endswith(".json"):
        if not Path(name).is_file():
            raise ConfigError(f"tokenizer {name}: no such file; prepare the data again, or pass an existing file")
        return TokenizerFile(Path(name))
    module, _, attribute = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(
            f"tokenizer {name!r}: {err}; name it as MODULE:ATTRIBUTE or a tokenizer.json file, or use {data.BYTES}"
        ) from None


def tokenizer_vocabulary(tokenizer) -> int:
    size = getattr(tokenizer, "n_vocab", None) or getattr(tokenizer, "vocab_size", None)
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"tokenizer {tokenizer!r} has no integer n_vocab or vocab_size")
    return size


def special_tokens(tokenizer, vocabulary: int) -> dict[str, int | None]:
    """The ids of the tokenizer's begin-of-text, end-of-text and padding tokens ("bos", "eos",
    "pad"), None where it has none: a tokenizer.json's by SPECIAL_NAMES; another object's
    bos_token_id, eos_token_id and pad_token_id (transformers' tokenizers), or its eot_token as the
    end of text (tiktoken's); bytes have none. An id outside the vocabulary is none."""
    if isinstance(tokenizer, TokenizerFile):
        found = tokenizer.special_ids()
    elif isinstance(tokenizer, ByteTokenizer):
        found = {}
    else:
        found = {role: getattr(tokenizer, f"{role}_token_id", None) for role in SPECIAL_NAMES}
        found["eos"] = found["eos"] if found["eos"] is not None else getattr(tokenizer, "eot_token", None)
    valid = {role: i for role, i in found.items() if isinstance(i, int) and 0 <= i < vocabulary}
    return {role: valid.get(role) for role in SPECIAL_NAMES}


def token_ids(files: list[Path], tokenizer) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):  # any bytes, valid UTF-8 or not
        text = b"".join(path.read_bytes() for path in files) if files else data.built_in_corpus()
        return np.frombuffer(text, dtype=np.uint8)
    texts = [path.read_text(encoding="utf-8") for path in files] if files else [data.built_in_corpus().decode("utf-8")]
    return np.array([token for text in texts for token in tokenizer.encode(text)], dtype=np.int64)


def prepare(
    files: list[Path],
    out: Path,
    eval_share: float | None = None,
    tokenizer_name: str | None = None,
    eval_files: list[Path] | None = None,
) -> dict:
    """Write out/train.bin, out/val.bin and out/meta.json (bytes as tokens unless `tokenizer_name`
    names a tokenizer); val.bin from `eval_files`, or from the last `eval_share` (default 0.1) of
    the files' tokens. Returns the meta record."""
    tokenizer_name = tokenizer_name or data.BYTES
    missing = [str(path) for path in [*files, *(eval_files or [])] if not path.is_file()]
    if missing:
        raise ConfigError(f"no such file: {', '.join(missing)}")
    if eval_files and eval_share is not None:
        raise ConfigError("--eval-share and --eval: pass one of them (the --eval files are the evaluation set)")
    eval_share = 0.1 if eval_share is None else eval_share
    if not 0 < eval_share < 1:
        raise ConfigError(f"--eval-share {eval_share}: use a share in (0, 1)")
    tokenizer = load_tokenizer(tokenizer_name)
    vocabulary = tokenizer_vocabulary(tokenizer)
    dtype = np.uint16 if vocabulary <= 2**16 else np.uint32
    tokens = token_ids(files, tokenizer).astype(dtype)
    if eval_files:
        parts = (tokens, token_ids(eval_files, tokenizer).astype(dtype))
    else:
        split = int(len(tokens) * (1 - eval_share))
        parts = (tokens[:split], tokens[split:])
    out.mkdir(parents=True, exist_ok=True)
    for part, name in zip(parts, data.SPLITS.values(), strict=True):
        part.tofile(out / name)
    if isinstance(tokenizer, TokenizerFile):  # the copy in the data folder is the one every later step reads
        if tokenizer.path.resolve() != (out / data.TOKENIZER_FILE).resolve():
            shutil.copyfile(tokenizer.path, out / data.TOKENIZER_FILE)
        tokenizer_name = data.TOKENIZER_FILE
    meta = {
        "dtype": np.dtype(dtype).name,
        "vocabulary_size": vocabulary,
        "tokenizer": tokenizer_name,
        "special_tokens": special_tokens(tokenizer, vocabulary),  # the exported model's ids (examples/huggingface)
        "tokens": {"train": len(parts[0]), "eval": len(parts[1])},
        "sources": {
            "train": [str(path.resolve()) for path in files] or ["built-in corpus"],
            "eval": [str(path.resolve()) for path in eval_files or []] or [f"the last {eval_share:g} of the tokens"],
        },
    }
    (out / data.META).write_text(json.dumps(meta, indent=2) + "\n")  # last: a directory with meta.json is complete
    return meta


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path, help="training text files (none: the built-in corpus)")
    parser.add_argument("--out", type=Path, required=True, help="directory for train.bin, val.bin, meta.json")
    parser.add_argument("--eval", nargs="+", type=Path, default=None, help="evaluation text files (val.bin)")
    parser.add_argument("--eval-share", type=float, default=None, help="without --eval: last share held out (0.1)")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json, or MODULE:ATTRIBUTE (default: bytes)")
    args = parser.parse_intermixed_args(argv)
    with exit_on_user_error():
        check_starter_data("tools.prepare")
        meta = prepare(args.files, args.out, args.eval_share, args.tokenizer, args.eval)
    print(
        f"{meta['tokens']['train']:,} training and {meta['tokens']['eval']:,} evaluation tokens "
        f"({meta['tokenizer']}, vocabulary {meta['vocabulary_size']:,}) in {args.out}; "
        f"train with dataset.dir={args.out.resolve()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
