"""A small decoder-only transformer: (B, T) token ids -> (B, T, vocab) logits.

Token and position embeddings, pre-norm blocks (causal scaled-dot-product attention, MLP),
a final LayerNorm and an output head tied to the token embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .base.rules import PositiveInt

if TYPE_CHECKING:
    from .config import Config


@dataclass
class ModelConfig:
    layers: PositiveInt = 2  # transformer blocks
    heads: PositiveInt = 4  # attention heads; width must be a multiple of heads
    width: PositiveInt = 64  # embedding width
    dropout: float = 0.0  # dropout in attention and MLP (0 for small data sets)


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.attention_norm, self.mlp_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        # no bias on q, k, v: a key bias shifts every score of a query alike, so softmax gives it a
        # zero gradient that Adam would turn into rounding-noise updates
        self.qkv, self.projection = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        x = x + self.projection(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, context: int, cfg: ModelConfig):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, cfg.width), nn.Embedding(context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads, cfg.dropout) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied: one matrix reads and writes tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tokens(input_ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(cfg: Config) -> nn.Module:
    return TinyGPT(vocab=256, context=cfg.dataset.context, cfg=cfg.model)
