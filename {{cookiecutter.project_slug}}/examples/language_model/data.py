"""Byte-level token windows over Python's own standard-library sources.

Each sample is a window of up to `context` bytes ending at a line break, padded to `context`:
`{"input_ids": (T,), "labels": (T,)}` with labels -100 on the padding, so samples (and ranks)
hold different numbers of loss terms.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset

from .base.rules import PositiveInt

if TYPE_CHECKING:
    from .config import Config

IGNORE = -100  # label of padding: cross_entropy's ignore_index


@dataclass
class DatasetConfig:
    context: PositiveInt = 32  # tokens (bytes) per window
    eval_share: float = 0.1  # the last share of the text is held out for evaluation


def corpus() -> bytes:
    """The json package's sources: real text that ships with every Python."""
    return b"".join(path.read_bytes() for path in sorted(Path(json.__file__).parent.glob("*.py")))


class LineWindows(Dataset):
    def __init__(self, text: bytes, context: int):
        self.text, self.context = torch.tensor(list(text), dtype=torch.long), context
        self.windows = []  # (start, length): a window ends at a line break, so lengths differ
        start = last_break = 0
        for end in (i + 1 for i, byte in enumerate(text) if byte == ord("\n")):
            if end - start > context + 1:  # this line would overflow the window: close it
                length = min(last_break - start, context + 1) if last_break > start + 1 else context + 1
                self.windows.append((start, length))
                start += length
            last_break = end

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int):
        start, length = self.windows[index]
        tokens = self.text[start : start + length]
        input_ids = torch.zeros(self.context, dtype=torch.long)
        labels = torch.full((self.context,), IGNORE, dtype=torch.long)
        input_ids[: length - 1], labels[: length - 1] = tokens[:-1], tokens[1:]
        return {"input_ids": input_ids, "labels": labels}


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset]:
    text = corpus()
    split = int(len(text) * (1 - cfg.dataset.eval_share))
    return LineWindows(text[:split], cfg.dataset.context), LineWindows(text[split:], cfg.dataset.context)
