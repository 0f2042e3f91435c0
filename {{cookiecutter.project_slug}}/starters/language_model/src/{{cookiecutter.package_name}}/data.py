"""Fixed-length windows of token ids for the language model.

`dataset.dir` names a directory written by `python -m {{ cookiecutter.package_name }}.tools.prepare`:
train.bin and val.bin (token ids), meta.json (their dtype, the vocabulary size and the
tokenizer) and, for a Hugging Face tokenizer, its tokenizer.json. The token files are read
through numpy.memmap, so ranks and loader workers share the operating system's page cache
instead of each holding a copy. Without `dataset.dir` the windows come from a built-in corpus,
the sources of a few packages of Python's standard library read as bytes, so that the smoke
check and a first run need neither preparation nor the network.

Sample i is window i of `model.context + 1` consecutive tokens, as (inputs, targets) with the
targets shifted by one: a map-style dataset, so DistributedSampler, set_epoch and mid-epoch
resume work as for any other data. Packed (the pack command, then `data.shards`), a record is
window i itself, in the token files' dtype, with the vocabulary size and the context it was cut
for kept in the pack.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import numpy as np
import torch
from torch.utils.data import Dataset

from .base import packs
from .base.rules import ConfigError, Rule

if TYPE_CHECKING:
    from .config import Config

BYTE_VOCABULARY = 256
BYTES = "bytes"  # the tokenizer of the built-in corpus: one token per byte
BUILT_IN_PACKAGES = ("json", "http")  # about 260 kB of Python: minutes of CPU training, seconds on a GPU
SPLITS = {"train": "train.bin", "eval": "val.bin"}
META = "meta.json"
TOKENIZER_FILE = "tokenizer.json"  # a `tokenizers` file, copied into the data directory by prepare
SPECIAL_TOKENS = ("bos", "eos", "pad")  # the roles of the special tokens meta.json records: begin, end of text, padding


@dataclass
class DatasetConfig:
    dir: str | None = None  # written by the prepare command (docs/language-model.md); null: Python's own sources
    eval_share: Annotated[float, Rule(lambda v: 0 < v < 1, "use a share in (0, 1)")] = 0.1  # built-in corpus only


def built_in_corpus() -> bytes:
    """Real text that ships with every Python: the standard library's sources, in a fixed order."""
    import importlib.util

    files = []
    for package in BUILT_IN_PACKAGES:
        files += sorted(Path(importlib.util.find_spec(package).origin).parent.rglob("*.py"))
    return b"".join(path.read_bytes() for path in files)


class TokenFile:
    """A token file, memory-mapped on first use in each process. Pickled (to a spawned loader
    worker) it carries its path, not its contents: a pickled memmap would be a full copy."""

    def __init__(self, path: Path, dtype: str):
        self.path, self.dtype, self.mapped = Path(path), np.dtype(dtype), None

    def __len__(self) -> int:
        return self.path.stat().st_size // self.dtype.itemsize

    def __getitem__(self, key):
        if self.mapped is None:
            self.mapped = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self.mapped[key]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "mapped": None}


class TokenWindows(Dataset):
    def __init__(self, tokens: np.ndarray | TokenFile, context: int):
        self.tokens, self.context = tokens, context

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.context)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs_and_targets(self.window(index))

    def window(self, index: int) -> np.ndarray:
        """The `context + 1` tokens of sample i, in the token file's dtype."""
        start = index * self.context
        return np.array(self.tokens[start : start + self.context + 1])


def inputs_and_targets(window: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.from_numpy(window.astype(np.int64))
    return tokens[:-1], tokens[1:]


class RawWindows(Dataset):
    """The windows of a TokenWindows as the pack command stores them."""

    def __init__(self, windows: TokenWindows):
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.windows.window(index)


class PackedWindows(Dataset):
    """(inputs, targets) samples of packed windows."""

    def __init__(self, records: Dataset):
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs_and_targets(self.records[index])


def read_meta(directory: str | Path) -> dict:
    path = Path(directory) / META
    if not path.is_file():
        raise ConfigError(
            f"dataset.dir: {directory} has no {META}; write it with "
            f"`python -m {{ cookiecutter.package_name }}.tools.prepare TEXT_FILES... --out {directory}`, "
            "or set dataset.dir=null for the built-in corpus"
        )
    return json.loads(path.read_text())


def vocabulary_size(cfg: Config) -> int:
    if cfg.data.shards is not None:
        return int(packs.facts(cfg.data)["vocabulary_size"])
    return BYTE_VOCABULARY if cfg.dataset.dir is None else int(read_meta(cfg.dataset.dir)["vocabulary_size"])


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset]:
    context = cfg.model.context
    if cfg.dataset.dir is None:
        tokens = np.frombuffer(built_in_corpus(), dtype=np.uint8)
        split = int(len(tokens) * (1 - cfg.dataset.eval_share))
        return TokenWindows(tokens[:split], context), TokenWindows(tokens[split:], context)
    meta = read_meta(cfg.dataset.dir)
    sets = []
    for name in SPLITS.values():
        tokens = TokenFile(Path(cfg.dataset.dir) / name, meta["dtype"])
        if len(tokens) <= context:
            raise ConfigError(
                f"dataset.dir: {name} holds {len(tokens)} tokens, fewer than one window of model.context + 1 = "
                f"{context + 1}; prepare more text or lower model.context"
            )
        sets.append(TokenWindows(tokens, context))
    return sets[0], sets[1]


def build_records(cfg: Config) -> tuple[Dataset, Dataset]:
    """What the pack command stores: each window of `model.context + 1` tokens, in the token files' dtype."""
    train, evaluation = build_datasets(cfg)
    return RawWindows(train), RawWindows(evaluation)


def from_records(cfg: Config, train: Dataset, evaluation: Dataset) -> tuple[Dataset, Dataset]:
    """(inputs, targets) samples of packed windows, which must have been cut for this model.context."""
    packed = packs.facts(cfg.data)["context"]
    if packed != cfg.model.context:
        raise ConfigError(
            f"model.context: {cfg.data.shards} holds windows for model.context={packed}, not {cfg.model.context}; "
            f"pass model.context={packed}, or pack again with model.context={cfg.model.context}"
        )
    return PackedWindows(train), PackedWindows(evaluation)


def tokenizer_name(cfg: Config) -> str:
    """The tokenizer the windows were cut with, as prepare.py records it: bytes, MODULE:ATTRIBUTE,
    or the absolute path of the tokenizer.json in the data directory."""
    if cfg.data.shards is not None:
        return packs.facts(cfg.data)["tokenizer"]
    if cfg.dataset.dir is None:
        return BYTES
    name = read_meta(cfg.dataset.dir)["tokenizer"]
    return str((Path(cfg.dataset.dir) / name).resolve()) if name.endswith(".json") else name


def tokenizer_file(cfg: Config) -> Path | None:
    """The tokenizer.json the data was cut with, which an exported model takes along; None for
    bytes or a tokenizer named MODULE:ATTRIBUTE."""
    name = tokenizer_name(cfg)
    return Path(name) if name.endswith(".json") else None


def special_tokens(cfg: Config) -> dict[str, int | None]:
    """The ids of the data's begin-of-text, end-of-text and padding tokens ("bos", "eos", "pad"), as
    prepare recorded them from the tokenizer; None where it has none (bytes have none, and data
    prepared before prepare recorded them has none on record)."""
    if cfg.data.shards is not None:
        recorded = packs.facts(cfg.data).get("special_tokens")
    else:
        recorded = None if cfg.dataset.dir is None else read_meta(cfg.dataset.dir).get("special_tokens")
    return {role: (recorded or {}).get(role) for role in SPECIAL_TOKENS}


def pack_facts(cfg: Config) -> dict:
    return {
        "vocabulary_size": vocabulary_size(cfg),
        "context": cfg.model.context,
        "tokenizer": tokenizer_name(cfg),
        "special_tokens": special_tokens(cfg),
    }
