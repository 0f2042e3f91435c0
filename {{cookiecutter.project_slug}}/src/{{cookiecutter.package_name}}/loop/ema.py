"""EMA weights (run.callbacks=[ema], the `ema` section): an exponential moving average of the
parameters, updated after every optimizer step from ema.start_step on,
evaluated under the prefix ema/ (eval/ema/accuracy), kept in every checkpoint and exported with
`tools.export --weights ema`.

    shadow <- decay * shadow + (1 - decay) * weights        each step from start_step
    shadow <- weights                                       each step before it

Under fsdp the shadow is a DTensor like each parameter: sharded as the weights are, never whole
on one rank. A tied weight (one parameter under two names) is averaged once. Buffers (BatchNorm's
statistics) stay the model's own, as torch.optim.swa_utils.AveragedModel keeps them by default:
they are the same on every rank after the evaluation's broadcast, an average of them would not be.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ..base.batching import unwrap
from .callbacks import Callback, Run, into_layout

PREFIX = "ema"


class EMA(Callback):
    section = "ema"

    def __init__(self, decay: float, start_step: int = 0):
        self.decay, self.start_step = decay, start_step
        self.names: list[str] = []
        self.shadow: list[torch.Tensor] = []

    def setup(self, run: Run) -> None:
        tracked = averaged(unwrap(run.model))
        self.names = list(tracked)
        self.shadow = [tensor.detach().clone() for tensor in tracked.values()]

    def after_step(self, run: Run) -> None:
        live = list(averaged(unwrap(run.model)).values())
        with torch.no_grad():
            if run.state.step <= self.start_step:
                copy_each(self.shadow, live)
            else:
                torch._foreach_lerp_(self.shadow, live, 1.0 - self.decay)  # one kernel for many tensors

    def models_to_evaluate(self, run: Run) -> Iterator[tuple[str, nn.Module]]:
        """The model with the shadow weights swapped in for the evaluation, its own put back after."""
        live = list(averaged(unwrap(run.model)).values())
        kept = [tensor.detach().clone() for tensor in live]
        copy_each(live, self.shadow)
        try:
            yield PREFIX, run.model
        finally:
            copy_each(live, kept)

    def state_dict(self) -> dict:
        return {"shadow": dict(zip(self.names, self.shadow, strict=True))}

    def load_state_dict(self, state: dict) -> None:
        saved = state["shadow"]
        missing = sorted(set(self.names) - set(saved))
        if missing:
            raise ValueError(f"the checkpoint's EMA weights lack {', '.join(missing[:3])}: another model wrote it")
        with torch.no_grad():
            for name, tensor in zip(self.names, self.shadow, strict=True):
                tensor.copy_(into_layout(saved[name], tensor))


@torch.no_grad()
def copy_each(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Each of `targets` overwritten in place by its source (one by one: DTensors have no _foreach_copy_)."""
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


def averaged(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters EMA averages, by name: each once (a tied one under its first name)."""
    return dict(module.named_parameters())
