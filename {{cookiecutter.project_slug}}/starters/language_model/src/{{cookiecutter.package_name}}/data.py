"""Fixed-length windows of token ids for the language model.

`dataset.dir` names a directory written by `python -m {{ cookiecutter.package_name }}.prepare`:
train.bin and val.bin (token ids) and meta.json (their dtype, the vocabulary size and the
tokenizer). The token files are read through numpy.memmap, so ranks and loader workers share
the operating system's page cache instead of each holding a copy. Without `dataset.dir` the
windows come from a built-in corpus, the sources of a few packages of Python's standard
library read as bytes, so that the smoke check and a first run need neither preparation nor
the network.

Sample i is window i of `model.context + 1` consecutive tokens, as (inputs, targets) with the
targets shifted by one: a map-style dataset, so DistributedSampler, set_epoch and mid-epoch
resume work as for any other data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import numpy as np
import torch
from torch.utils.data import Dataset

from .rules import ConfigError, Rule

if TYPE_CHECKING:
    from .config import Config

BYTE_VOCABULARY = 256
BUILT_IN_PACKAGES = ("json", "http")  # about 260 kB of Python: minutes of CPU training, seconds on a GPU
SPLITS = {"train": "train.bin", "eval": "val.bin"}
META = "meta.json"


@dataclass
class DatasetConfig:
    dir: str | None = None  # written by the prepare command (see README); null: Python's own sources
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
        start = index * self.context
        window = torch.from_numpy(self.tokens[start : start + self.context + 1].astype(np.int64))
        return window[:-1], window[1:]


def read_meta(directory: str | Path) -> dict:
    path = Path(directory) / META
    if not path.is_file():
        raise ConfigError(
            f"dataset.dir: {directory} has no {META}; write it with "
            f"`python -m {{ cookiecutter.package_name }}.prepare TEXT_FILES... --out {directory}`, or set dataset.dir=null "
            "for the built-in corpus"
        )
    return json.loads(path.read_text())


def vocabulary_size(cfg: Config) -> int:
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
