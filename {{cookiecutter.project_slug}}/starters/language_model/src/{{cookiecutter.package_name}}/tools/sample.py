"""Generate text with a trained language model.

    python -m {{ cookiecutter.package_name }}.tools.sample CHECKPOINT --prompt "def " --tokens 200
        [--temperature 0.8] [--top-k 40] [--seed 1] [--device cpu]

CHECKPOINT is a training checkpoint (runs/<name>/checkpoints/step_*.pt) or a run directory
(its newest loadable checkpoint), from any working directory: the config saved in the checkpoint
rebuilds the model, its relative paths read from the directory the run was launched from, and
names the tokenizer (dataset.dir's meta.json and the tokenizer.json beside it, or bytes). The model
is the starter's GPT or any model whose forward takes token ids and returns logits, or an output
holding them as `.logits` (a transformers causal LM); its context is its `context`, or
`config.max_position_embeddings`. Runs on CUDA when there is a GPU, else on the CPU (--device
picks). Prints the prompt followed by the generated text.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .. import config, data, task
from ..base.rules import ConfigError, exit_on_user_error
from ..loop import checkpoint
from .export import launched_from
from .prepare import check_starter_data, load_tokenizer


@torch.no_grad()
def generate(model, prompt: list[int], tokens: int, temperature: float, top_k: int | None, generator=None):
    """`tokens` new token ids after `prompt`, sampled one at a time; the model sees at most its
    context, so the oldest tokens drop out of view as the text grows."""
    model.eval()
    device, context = next(model.parameters()).device, context_of(model)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(tokens):
        output = model(ids[:, -context:])
        logits = getattr(output, "logits", output)[:, -1, :].float()
        if temperature == 0:
            following = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            following = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        ids = torch.cat([ids, following], dim=1)
    return ids[0, len(prompt) :].tolist()


def context_of(model) -> int | None:
    """How many tokens the model sees at once: the starter's `context`, or a transformers config's."""
    context = getattr(model, "context", None)
    if context is None:
        context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return context if isinstance(context, int) else None


def load(path: Path, device: torch.device):
    """(model on `device`, tokenizer) from a checkpoint file or a run directory."""
    found, state = checkpoint.find(path)
    cfg = config.from_dict(state["config"])
    with launched_from(found, cfg.run, state):  # dataset.dir as the run read it, wherever this command runs
        model = task.build_model(cfg)
        tokenizer = load_tokenizer(data.tokenizer_name(cfg))
    if context_of(model) is None:
        raise ConfigError(
            "tools.sample generates with a model that has a `context` (the starter's GPT) or a transformers "
            "config's max_position_embeddings, and yours has neither: adapt generate() in tools/sample.py to "
            "your model, or delete it"
        )
    model.load_state_dict(state["model"])
    return model.to(device), tokenizer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a step_*.pt file or a run directory")
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: always the likeliest token")
    parser.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--seed", type=int, default=None, help="for a repeatable sample")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    with exit_on_user_error():
        check_starter_data("tools.sample")
        if args.tokens < 0 or args.temperature < 0:
            raise ConfigError("--tokens and --temperature: use numbers >= 0")
        model, tokenizer = load(args.checkpoint, torch.device(args.device))
        prompt = tokenizer.encode(args.prompt)
        if not prompt:
            raise ConfigError("--prompt: give at least one character to continue")
    generator = torch.Generator(args.device).manual_seed(args.seed) if args.seed is not None else None
    new = generate(model, prompt, args.tokens, args.temperature, args.top_k or None, generator)
    print(args.prompt + tokenizer.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
