"""A small convolutional language model: (B, T) token ids -> (B, T, vocabulary) logits.

An embedding, residual layers of causal 1-D convolutions (each pads on the left only, so
position t sees the `layers x (kernel - 1) + 1` tokens up to t and padding at the end changes
nothing before it), a LayerNorm and an output head tied to the embedding. The project's language-model
starter (cookiecutter's task=language_model) is a transformer; the seam does not care which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .rules import PositiveInt

if TYPE_CHECKING:
    from .config import Config


@dataclass
class ModelConfig:
    layers: PositiveInt = 3  # residual convolution layers
    width: PositiveInt = 128  # embedding and channel width
    kernel: PositiveInt = 5  # tokens each convolution reads


class ConvolutionalLM(nn.Module):
    def __init__(self, vocabulary: int, cfg: ModelConfig):
        super().__init__()
        self.tokens = nn.Embedding(vocabulary, cfg.width)
        self.convolutions = nn.ModuleList(nn.Conv1d(cfg.width, cfg.width, cfg.kernel) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, vocabulary, bias=False)
        self.head.weight = self.tokens.weight  # tied: one matrix reads and writes tokens
        nn.init.normal_(self.tokens.weight, std=cfg.width**-0.5)  # unit-scale logits from the tied head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(input_ids).transpose(1, 2)  # (B, width, T): channels first for Conv1d
        for convolution in self.convolutions:
            x = x + F.gelu(convolution(F.pad(x, (convolution.kernel_size[0] - 1, 0))))
        return self.head(self.norm(x.transpose(1, 2)))


def build_model(cfg: Config) -> nn.Module:
    return ConvolutionalLM(vocabulary=256, cfg=cfg.model)
