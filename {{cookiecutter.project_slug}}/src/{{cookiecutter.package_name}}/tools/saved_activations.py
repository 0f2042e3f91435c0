"""What autograd keeps of one micro-batch's forward for its backward, unit by unit: the tracing
behind `diagnose memory`'s activation estimate (on fake tensors, at any size) and the tests'
measurements of activation checkpointing (on real ones)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils import _pytree

from .. import task
from ..base import hardware


@dataclass
class SavedForBackward:
    """What autograd keeps from one micro-batch's forward for its backward, as bytes by storage (a
    storage saved twice counts once; parameters and their autocast copies are the static memory's):
    what the forward saves before the units run and after they all have (a head, the loss), and
    each unit's inputs and its own, in the order the units ran."""

    before: dict[int, int] = field(default_factory=dict)
    after: dict[int, int] = field(default_factory=dict)
    inputs: list[dict[int, int]] = field(default_factory=list)
    own: list[dict[int, int]] = field(default_factory=list)
    order: list[int] = field(default_factory=list)

    def kept_bytes(self, recompute: list[int]) -> int:
        """What the forward leaves saved when the units `recompute` names keep only their inputs."""
        held = dict(self.before)
        for index in self.order:
            held.update(self.inputs[index] if index in recompute else self.own[index])
        return sum({**held, **self.after}.values())

    def activation_bytes(self, recompute: list[int]) -> int:
        """The most activation memory held at once when the units `recompute` names keep only
        their inputs: at the end of the forward (kept_bytes), or when backward, having freed what
        came after a unit, recomputes that unit's own."""
        held, levels = dict(self.before), [self.kept_bytes(recompute)]
        for index in self.order:
            held.update(self.inputs[index] if index in recompute else self.own[index])
            if index in recompute:
                again = sum(size for key, size in self.own[index].items() if key not in held)
                levels.append(sum(held.values()) + again)
        return max(levels)


def saved_for_backward(model: nn.Module, batch, chosen: list[nn.Module], precision: str) -> SavedForBackward:
    """Trace task.loss_sum(model, batch) once under the precision's autocast, recording the
    tensors autograd saves for backward and where in the model it saves them. Works alike on real
    tensors (a measurement) and on fake ones (an estimate at any size, no memory: diagnose memory)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    parameters = {_storage(p) for p in model.parameters()}
    casts: set[int] = set()  # autocast's low-precision copies of the parameters

    class ParameterCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and _storage(args[0]) in parameters:
                casts.add(_storage(result))
            return result

    saved, current, alive = SavedForBackward(), [None], []  # alive: no storage freed and its identity reused
    hooks = []
    for index, unit in enumerate(chosen):
        saved.inputs.append({})
        saved.own.append({})

        def enter(module, args, kwargs, index=index):
            current[0] = index
            if index not in saved.order:
                saved.order.append(index)
            for tensor in _pytree.tree_leaves((args, kwargs)):
                if isinstance(tensor, torch.Tensor):
                    alive.append(tensor)
                    saved.inputs[index][_storage(tensor)] = tensor.untyped_storage().nbytes()

        def leave(module, args, output):
            current[0] = None

        hooks += [unit.register_forward_pre_hook(enter, with_kwargs=True), unit.register_forward_hook(leave)]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage(tensor)
        if key not in parameters and key not in casts:
            if current[0] is not None:
                where = saved.own[current[0]]
            else:
                where = saved.after if chosen and len(saved.order) == len(chosen) else saved.before
            where.setdefault(key, tensor.untyped_storage().nbytes())
        return tensor

    autocast = hardware.autocast(precision, next(model.parameters()).device)
    try:
        with ParameterCasts(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
            loss = task.loss_sum(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    del loss  # and with it the graph and what it saved
    for own in saved.own:  # a storage first met before the units counts there
        for key in [key for key in own if key in saved.before]:
            del own[key]
    return saved


def _storage(tensor: torch.Tensor) -> int:
    """An identity of the tensor's storage, shared by its views, for real and fake tensors alike."""
    return tensor.untyped_storage()._cdata
