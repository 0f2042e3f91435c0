"""A Hugging Face `transformers` causal language model, built from a config and never downloaded:
(B, T) token ids -> an output whose `.logits` are (B, T, vocabulary).

Two ways to say which model:
- `model.config`: a config.json (or the folder holding it), e.g. a Llama's or a Mistral's, copied
  from wherever you keep it; its sizes are used as they are, its vocabulary becomes the prepared
  data's (`dataset.dir`'s meta.json), and `model.context` must fit its max_position_embeddings.
  The settings below that it decides (sizes, tie_embeddings, dropout) are not used: a start-up
  note names those that differ from the file;
- or, without it, `model.model_type` (any architecture transformers' AutoConfig knows: llama,
  gpt2, mistral, qwen2, ...) and the sizes below, each set where that architecture has it
  (a GPT-2 has no key/value heads or MLP width of its own).
Either way the special-token ids (bos, eos, pad) are the data tokenizer's, as prepare recorded
them, or None where it has none: a config file's own ids name other tokens in another vocabulary,
and generate() on the export would stop at them.
The weights are initialised as the architecture initialises them (from_config, seeded alike on
every rank); no pretrained weights are read. The model's own loss (`labels=`) is a mean, so
task.py computes the summed cross-entropy from the logits instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import torch
from torch import nn

from .base.rules import ConfigError, PositiveInt, Rule
from .data import special_tokens, vocabulary_size

if TYPE_CHECKING:
    from .config import Config

Probability = Annotated[float, Rule(lambda v: 0 <= v < 1, "use a probability in [0, 1)")]
OptionalSize = Annotated[int | None, Rule(lambda v: v is None or v > 0, "use null or a positive size")]


@dataclass
class ModelConfig:
    config: str | None = None  # a transformers config.json (or its folder) to build; null: model_type and sizes below
    model_type: str = "llama"  # without config: transformers' architecture name (llama, gpt2, mistral, qwen2, ...)
    layers: PositiveInt = 2  # decoder layers (num_hidden_layers)
    heads: PositiveInt = 4  # attention heads; width must be a multiple of heads
    kv_heads: PositiveInt = 2  # key/value heads (grouped-query attention): a divisor of heads; Llama-style models
    width: PositiveInt = 64  # hidden size
    mlp_width: OptionalSize = None  # the MLP's inner size, Llama-style models; null: 8/3 x width (GPT-2: 4 x)
    context: PositiveInt = 64  # tokens the model sees at once: the training window (max_position_embeddings)
    tie_embeddings: bool = True  # the output head shares the input embedding's matrix (tie_word_embeddings)
    dropout: Probability = 0.0  # the architecture's dropout rates, where it has them (0 for the proofs)


# transformers' names of ModelConfig's settings; each goes to an architecture that has it
SETTINGS = {
    "num_hidden_layers": "layers",
    "num_attention_heads": "heads",
    "num_key_value_heads": "kv_heads",
    "hidden_size": "width",
    "intermediate_size": "mlp_width",
    "max_position_embeddings": "context",
    "tie_word_embeddings": "tie_embeddings",
}
DROPOUTS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")


def transformers_config(cfg: Config):
    """The transformers config of the model: model.config's file, or model.model_type with the
    sizes; the vocabulary is the prepared data's either way."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "model.py builds a transformers model, and transformers is not installed: pip install -e '.[huggingface]'"
        ) from None
    vocabulary = vocabulary_size(cfg)
    special = {f"{role}_token_id": token_id for role, token_id in special_tokens(cfg).items()}
    if cfg.model.config is not None:
        if not Path(cfg.model.config).exists():
            raise ConfigError(f"model.config: {cfg.model.config} does not exist; pass a config.json or its folder")
        built = transformers.AutoConfig.from_pretrained(cfg.model.config, vocab_size=vocabulary, **special)
        longest = getattr(built, "max_position_embeddings", None)
        if longest is not None and cfg.model.context > longest:
            raise ConfigError(
                f"model.context: {cfg.model.context} is longer than {cfg.model.config}'s max_position_embeddings "
                f"({longest}); use model.context={longest} or less"
            )
        note = unused_settings_note(cfg, built)
        if note and not (torch.distributed.is_initialized() and torch.distributed.get_rank() > 0):
            print(note, flush=True)  # at start-up, once: rank 0's
        return built
    if cfg.model.width % cfg.model.heads or cfg.model.heads % cfg.model.kv_heads:
        raise ConfigError(
            f"model.width ({cfg.model.width}), model.heads ({cfg.model.heads}), model.kv_heads ({cfg.model.kv_heads}): "
            "the width must be a multiple of the heads and the heads of the key/value heads"
        )
    try:
        defaults = transformers.AutoConfig.for_model(cfg.model.model_type)
    except ValueError:
        raise ConfigError(
            f"model.model_type: transformers {transformers.__version__} knows no {cfg.model.model_type!r}; "
            "use an architecture name such as llama, gpt2, mistral or qwen2"
        ) from None
    settings = {**vars(cfg.model), "mlp_width": cfg.model.mlp_width or mlp_width(cfg.model.width)}
    sizes = {name: settings[ours] for name, ours in SETTINGS.items() if hasattr(defaults, name)}
    dropouts = {name: cfg.model.dropout for name in DROPOUTS if hasattr(defaults, name)}
    # the data's special tokens: ids the defaults name (GPT-2's 50256) may lie outside its vocabulary
    return transformers.AutoConfig.for_model(
        cfg.model.model_type, vocab_size=vocabulary, **sizes, **dropouts, **special
    )


def unused_settings_note(cfg: Config, built) -> str | None:
    """One line naming the settings that model.config's file decides and that are set otherwise
    (config sync keeps every model.* setting in configs/default.yaml, where they look in use); None
    when the file agrees with them all. model.context is not one: it is the training window."""
    ours = [("model_type", "model_type"), *((name, key) for name, key in SETTINGS.items() if key != "context")]
    ours += [(name, "dropout") for name in DROPOUTS]
    differ = {}
    for name, key in ours:
        value = getattr(cfg.model, key)
        if value is not None and hasattr(built, name) and getattr(built, name) != value:
            differ.setdefault(key, f"model.{key}={value} (the file: {name}={getattr(built, name)})")
    if not differ:
        return None
    verb = "are" if len(differ) > 1 else "is"
    return f"note: model.config {cfg.model.config} decides the model: {', '.join(differ.values())} {verb} not used"


def mlp_width(width: int) -> int:
    """Llama's rule: 2/3 of 4 x width (its gated MLP has three matrices, not two), up to a multiple of 32."""
    return -(-8 * width // 3 // 32) * 32


def build_model(cfg: Config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(transformers_config(cfg))


def training_flops_per_token(model: nn.Module, context: int) -> float:
    """Forward + backward FLOPs per token: 6 per weight that multiplies (every parameter but an
    untied input embedding, which is looked up; a tied one counts once, as the output head), plus
    attention's scores and weighted sum, 2 x 2 x context x width per layer forward, x 3."""
    weights = sum(p.numel() for p in model.parameters())
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if embedding is not head:
        weights -= embedding.numel()
    config = model.config
    return 6 * weights + 12 * config.num_hidden_layers * context * config.hidden_size
