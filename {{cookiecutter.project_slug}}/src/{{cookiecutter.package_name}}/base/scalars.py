"""Named scalars: a number the task or a callback logs by name, reduced over the log window and
over the ranks, and written with the loss to every sink (console, metrics.jsonl, TensorBoard,
W&B, MLflow) under train/<name>.

    from .base import scalars
    scalars.add("weight_norm", norm)                          # mean over the window's adds and the ranks
    scalars.add("aux_loss", aux_sum, reduce="per_term")       # a sum over loss terms, per term like the loss
    scalars.add("skipped", 1.0, reduce="sum")                 # summed over the window and the ranks
    scalars.add("max_logit", logits.max(), reduce="max")      # the largest of the window on any rank

`add` takes a float or a tensor on the device and costs one device add (no host sync). Outside
a training log window (evaluation, the smoke check) it does nothing. A rank may add a name that
another does not in a window: the ranks agree on the names at the window's end (one more
collective in the first window that names a new one), and each value counts only the adds made.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

REDUCTIONS = ("mean", "sum", "max", "per_term")
RESERVED = frozenset(  # the log's own fields (loop/metrics.py), and where a record sits
    {"kind", "step", "epoch", "loss", "lr", "grad_norm", "samples_per_s", "data_wait_share", "step_ms", "mfu"}
    | {
        "data_wait_ms",
        "fwd_bwd_ms",
        "optimizer_ms",
        "other_ms",
        "peak_mem_gib",
        "world_size",
        "start_step",
        "elapsed_s",
    }
)


def add(name: str, value, reduce: str = "mean") -> None:
    """Add `value` to the scalar `name` of the current log window; nothing outside one."""
    if _window is not None:
        _window.add(name, value, reduce)


@contextmanager
def paused():
    """No scalar is added inside (an evaluation runs the model, and the task's adds are training's)."""
    global _window
    window, _window = _window, None
    try:
        yield
    finally:
        _window = window


class Window:
    """This rank's named scalars of one log window: their sums (max: their maximum) on the device
    in float64, the adds counted on the host."""

    def __init__(self, device: torch.device, agreed: dict[str, str] | None = None):
        self.device = device
        self.agreed = dict(agreed or {})  # name -> reduction, known to every rank (sorted at packing)
        self.values: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.kinds: dict[str, str] = {}

    def add(self, name: str, value, reduce: str) -> None:
        if reduce not in REDUCTIONS:
            raise ValueError(f"scalars.add({name!r}, reduce={reduce!r}): use one of {', '.join(REDUCTIONS)}")
        if name in RESERVED:
            raise ValueError(f"scalars.add({name!r}): the log writes {name!r} itself; choose another name")
        known = self.agreed.get(name) or self.kinds.get(name)
        if known not in (None, reduce):
            raise ValueError(f"scalars.add({name!r}, reduce={reduce!r}): it was added with reduce={known!r} before")
        if hasattr(value, "full_tensor"):  # a DTensor (fsdp): its whole value, a collective every rank makes here
            value = value.full_tensor()
        value = torch.as_tensor(value, dtype=torch.float64).to(self.device, non_blocking=True).detach()
        if name not in self.values:
            self.values[name], self.counts[name], self.kinds[name] = value.clone(), 1, reduce
        elif reduce == "max":
            self.values[name] = torch.maximum(self.values[name], value)
        else:
            self.values[name] += value
            self.counts[name] += 1

    def new_names(self) -> dict[str, str]:
        """The names this rank added that the ranks have not agreed on yet."""
        return {name: kind for name, kind in self.kinds.items() if name not in self.agreed}

    def packed(self, names: dict[str, str], rank: int, world_size: int) -> torch.Tensor:
        """One float64 vector of `names` (sorted) for a sum over ranks: [sum, adds] per name, and
        for a maximum one slot per rank (this rank's in its own, -inf without an add)."""
        parts = []
        for name in sorted(names):
            value = self.values.get(name)
            if names[name] == "max":
                slots = torch.zeros(world_size, dtype=torch.float64, device=self.device)
                slots[rank] = value if value is not None else -math.inf
                parts.append(slots)
            else:
                total = value if value is not None else torch.zeros((), dtype=torch.float64, device=self.device)
                adds = torch.tensor(float(self.counts.get(name, 0)), dtype=torch.float64).to(self.device)
                parts.append(torch.stack([total, adds]))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=self.device)


def unpacked(names: dict[str, str], summed: list[float], world_size: int, terms: float) -> dict[str, float]:
    """The values of `names` from `packed` vectors summed over ranks; a name without an add on any
    rank is left out. `terms`: the window's loss terms over every rank (per_term divides by them)."""
    values, at = {}, 0
    for name in sorted(names):
        kind = names[name]
        if kind == "max":
            peak, at = max(summed[at : at + world_size]), at + world_size
            if peak != -math.inf:
                values[name] = peak
            continue
        total, adds = summed[at], summed[at + 1]
        at += 2
        if adds:
            values[name] = {"mean": total / adds, "sum": total, "per_term": total / max(terms, 1.0)}[kind]
    return values


def open_window(window: Window | None) -> None:
    """Make `window` the one `add` adds to (the training log, at each window's start); None: none."""
    global _window
    _window = window


_window: Window | None = None
