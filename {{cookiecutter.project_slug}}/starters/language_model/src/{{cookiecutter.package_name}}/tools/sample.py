"""Generate text with a trained language model.

    python -m {{ cookiecutter.package_name }}.tools.sample CHECKPOINT --prompt "def " --tokens 200
        [--temperature 0.8] [--top-k 40] [--seed 1] [--device cpu]

CHECKPOINT is a training checkpoint (runs/<name>/checkpoints/step_*.pt) or a run directory
(its newest loadable checkpoint). The config saved in the checkpoint rebuilds the model and names the
tokenizer (dataset.dir's meta.json, or bytes). Runs on CUDA when there is a GPU, else on the
CPU (--device picks). Prints the prompt followed by the generated text.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .. import checkpoint, config, data, task
from ..rules import ConfigError, exit_on_user_error
from .prepare import check_starter_data, load_tokenizer


@torch.no_grad()
def generate(model, prompt: list[int], tokens: int, temperature: float, top_k: int | None, generator=None):
    """`tokens` new token ids after `prompt`, sampled one at a time; the model sees at most its
    context, so the oldest tokens drop out of view as the text grows."""
    model.eval()
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(tokens):
        logits = model(ids[:, -model.context :])[:, -1, :].float()
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


def load(path: Path, device: torch.device):
    """(model on `device`, tokenizer) from a checkpoint file or a run directory."""
    _, state = checkpoint.find(path)
    cfg = config.from_dict(state["config"])
    model = task.build_model(cfg)
    if not isinstance(getattr(model, "context", None), int):
        raise ConfigError(
            "tools.sample generates with the starter's GPT (forward(token ids) -> logits, and its `context`), "
            "and your model has no `context`: adapt generate() in tools/sample.py to your model, or delete it"
        )
    model.load_state_dict(state["model"])
    tokenizer = load_tokenizer(data.tokenizer_name(cfg))
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
