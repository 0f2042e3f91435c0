"""Tokenize text files into the token files the language model trains on.

    python -m {{ cookiecutter.package_name }}.tools.prepare TEXT_FILES... --out DIR   # then dataset.dir=DIR
    python -m {{ cookiecutter.package_name }}.tools.prepare --out DIR                 # the built-in corpus

The files' tokens are concatenated in the order given; the last --eval-share of them becomes
DIR/val.bin, the rest DIR/train.bin, and DIR/meta.json records the token dtype, the
vocabulary size and the tokenizer, which `sample` reloads. The default tokenizer is byte-level
(256 ids, any file, nothing to download). Another one is named as MODULE:ATTRIBUTE, an object
with encode(str) -> list[int], decode(list[int]) -> str and its vocabulary size as `n_vocab`
or `vocab_size` (tiktoken's encodings have these): e.g. a file mytokenizer.py holding
`gpt2 = tiktoken.get_encoding("gpt2")`, then `--tokenizer mytokenizer:gpt2`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import numpy as np

from .. import data
from ..rules import ConfigError, exit_on_user_error

# what this command writes for: the starter's data.py; after a swap of data.py it says so in one line
STARTER_DATA = ("BYTE_VOCABULARY", "BYTES", "META", "SPLITS", "built_in_corpus", "tokenizer_name")


def check_starter_data(command: str) -> None:
    missing = [name for name in STARTER_DATA if not hasattr(data, name)]
    if missing:
        raise ConfigError(
            f"{command} works with the language-model starter's data.py (token files, a tokenizer), and yours "
            f"has no {missing[0]}: adapt {command.replace('.', '/')}.py to your data, or delete it"
        )


class ByteTokenizer:
    """UTF-8 bytes as tokens: no vocabulary to learn or download; decoding replaces broken characters."""

    @property
    def vocab_size(self) -> int:
        return data.BYTE_VOCABULARY

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


def load_tokenizer(name: str):
    if name == data.BYTES:
        return ByteTokenizer()
    module, _, attribute = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"tokenizer {name!r}: {err}; name it as MODULE:ATTRIBUTE, or use {data.BYTES}") from None


def tokenizer_vocabulary(tokenizer) -> int:
    size = getattr(tokenizer, "n_vocab", None) or getattr(tokenizer, "vocab_size", None)
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"tokenizer {tokenizer!r} has no integer n_vocab or vocab_size")
    return size


def token_ids(files: list[Path], tokenizer) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):  # any bytes, valid UTF-8 or not
        text = b"".join(path.read_bytes() for path in files) if files else data.built_in_corpus()
        return np.frombuffer(text, dtype=np.uint8)
    texts = [path.read_text(encoding="utf-8") for path in files] if files else [data.built_in_corpus().decode("utf-8")]
    return np.array([token for text in texts for token in tokenizer.encode(text)], dtype=np.int64)


def prepare(files: list[Path], out: Path, eval_share: float, tokenizer_name: str | None = None) -> dict:
    """Write out/train.bin, out/val.bin and out/meta.json (bytes as tokens unless `tokenizer_name`
    names a tokenizer); returns the meta record."""
    tokenizer_name = tokenizer_name or data.BYTES
    missing = [str(path) for path in files if not path.is_file()]
    if missing:
        raise ConfigError(f"no such file: {', '.join(missing)}")
    if not 0 < eval_share < 1:
        raise ConfigError(f"--eval-share {eval_share}: use a share in (0, 1)")
    tokenizer = load_tokenizer(tokenizer_name)
    vocabulary = tokenizer_vocabulary(tokenizer)
    dtype = np.uint16 if vocabulary <= 2**16 else np.uint32
    tokens = token_ids(files, tokenizer).astype(dtype)
    split = int(len(tokens) * (1 - eval_share))
    out.mkdir(parents=True, exist_ok=True)
    for part, name in zip((tokens[:split], tokens[split:]), data.SPLITS.values(), strict=True):
        part.tofile(out / name)
    meta = {
        "dtype": np.dtype(dtype).name,
        "vocabulary_size": vocabulary,
        "tokenizer": tokenizer_name,
        "tokens": {"train": split, "eval": len(tokens) - split},
        "sources": [str(path) for path in files] or ["built-in corpus"],
    }
    (out / data.META).write_text(json.dumps(meta, indent=2) + "\n")  # last: a directory with meta.json is complete
    return meta


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path, help="text files (none: the built-in corpus)")
    parser.add_argument("--out", type=Path, required=True, help="directory for train.bin, val.bin, meta.json")
    parser.add_argument("--eval-share", type=float, default=0.1, help="last share of the tokens held out")
    parser.add_argument("--tokenizer", default=None, help="MODULE:ATTRIBUTE (default: bytes)")
    args = parser.parse_args(argv)
    with exit_on_user_error():
        check_starter_data("tools.prepare")
        meta = prepare(args.files, args.out, args.eval_share, args.tokenizer)
    print(
        f"{meta['tokens']['train']:,} training and {meta['tokens']['eval']:,} evaluation tokens "
        f"({meta['tokenizer']}, vocabulary {meta['vocabulary_size']:,}) in {args.out}; "
        f"train with dataset.dir={args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
