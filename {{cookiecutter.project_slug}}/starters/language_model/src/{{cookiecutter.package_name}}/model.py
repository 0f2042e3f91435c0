"""A GPT-style decoder-only transformer: (B, T) token ids -> (B, T, vocabulary) logits.

Token and position embeddings, pre-norm blocks (causal scaled-dot-product attention, then an
MLP), a final LayerNorm and an output head tied to the token embedding. Initialised as GPT-2:
weights normal(0, 0.02), biases zero, and the projections that write into the residual stream
scaled by 1/sqrt(2 x layers) so that its variance does not grow with depth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import torch
import torch.nn.functional as F
from torch import nn

from .base.rules import ConfigError, PositiveInt, Rule
from .data import vocabulary_size

if TYPE_CHECKING:
    from .config import Config

Probability = Annotated[float, Rule(lambda v: 0 <= v < 1, "use a probability in [0, 1)")]


@dataclass
class ModelConfig:
    layers: PositiveInt = 2  # transformer blocks
    heads: PositiveInt = 2  # attention heads; width must be a multiple of heads
    width: PositiveInt = 64  # embedding width
    context: PositiveInt = 64  # tokens the model sees at once (the training window)
    dropout: Probability = 0.0  # after the embeddings, attention and MLP (0 for small data)


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.attention_norm, self.mlp_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        # no bias on q, k, v: a key bias shifts every score of a query alike, so softmax gives it
        # a zero gradient that Adam would turn into rounding-noise updates
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.attention_out = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        x = x + self.residual_dropout(self.attention_out(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.residual_dropout(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    def __init__(self, vocabulary: int, cfg: ModelConfig):
        super().__init__()
        self.context = cfg.context
        self.tokens, self.positions = nn.Embedding(vocabulary, cfg.width), nn.Embedding(cfg.context, cfg.width)
        self.embedding_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads, cfg.dropout) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, vocabulary, bias=False)
        self.head.weight = self.tokens.weight  # tied: one matrix reads and writes tokens
        self.apply(_init_gpt2)
        for block in self.blocks:
            for projection in (block.attention_out, block.mlp[-1]):
                nn.init.normal_(projection.weight, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding_dropout(self.tokens(tokens) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _init_gpt2(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_model(cfg: Config) -> nn.Module:
    if cfg.model.width % cfg.model.heads:
        raise ConfigError(
            f"model.width: {cfg.model.width} is not a multiple of model.heads ({cfg.model.heads}); "
            f"use e.g. model.width={cfg.model.heads * max(1, round(cfg.model.width / cfg.model.heads))}"
        )
    return GPT(vocabulary_size(cfg), cfg.model)


def training_flops_per_token(model: GPT) -> float:
    """Forward + backward FLOPs per token: 6 per weight that multiplies (every parameter but the
    position table, which is looked up; the tied token matrix counts once, as the output head),
    plus attention's scores and weighted sum, 2 x 2 x context x width per layer forward, x 3."""
    weights = sum(p.numel() for p in model.parameters()) - model.positions.weight.numel()
    width = model.positions.weight.shape[1]
    return 6 * weights + 12 * len(model.blocks) * model.context * width
