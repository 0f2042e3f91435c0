"""parallel.strategy=fsdp and activation checkpointing: the model split into units, each unit's
activations recomputed in backward when asked, then each unit sharded over the ranks (FSDP2's
fully_shard), the root last: torchtitan's order, checkpointing -> compile -> shard.

Under FSDP every rank holds 1/N of the parameters, gradients and optimizer state; a unit's
parameters are gathered for its forward and backward and freed after them. The units come from
the seam (task.shard_units(model), optional) or from `default_units`. A parameter shared by two
modules (tied weights) must sit in one unit or in the root's group, which holds every parameter
no unit took. BatchNorm layers get a group of their own in fp32 (their statistics would not
survive bf16), and their buffers are not synchronised by FSDP: the loop broadcasts rank 0's before
evaluating and saving, which is what DDP's broadcast at each forward leaves (see train.evaluate).
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import task
from ..base import dist, hardware
from ..base.rules import ConfigError

if TYPE_CHECKING:
    from ..base.dist import DistInfo
    from ..config import Config, OptimConfig, ParallelConfig

FSDP_FLOOR = (2, 8)  # gloo refuses FSDP's averaging reduce-scatter (ReduceOp.AVG) before 2.8
LOW_PRECISION = {name: dtype for name, dtype in hardware.AUTOCAST_DTYPES.items() if name != "fp32"}


def floor_problem(version: str = torch.__version__) -> str | None:
    """Why torch `version` cannot shard a model here, or None."""
    major, minor = (int(part) for part in version.split(".")[:2])
    if (major, minor) >= FSDP_FLOOR:
        return None
    floor = ".".join(map(str, FSDP_FLOOR))
    return (
        f"parallel.strategy: fsdp needs torch>={floor} (this is {version}): pip install 'torch>={floor}', "
        "or use parallel.strategy=ddp"
    )


def check(cfg: Config, device: torch.device) -> None:
    """Before any collective, on every rank: the strategy's settings can run here."""
    if cfg.parallel.strategy == "fsdp" and floor_problem():
        raise ConfigError(floor_problem())
    if cfg.parallel.strategy == "fsdp" and cfg.train.precision == "fp16":
        # GradScaler finds an overflow in this rank's shard only: ranks would skip different steps
        raise ConfigError(
            "train.precision: fp16 under parallel.strategy=fsdp would let each rank skip its own overflowing "
            "steps (GradScaler sees only its shard): use bf16 (or fp32), or parallel.strategy=ddp"
        )
    if cfg.parallel.strategy == "fsdp" and cfg.parallel.cpu_offload and device.type != "cuda":
        raise ConfigError(
            "parallel.cpu_offload: moves GPU state to CPU memory, and this run has no GPU: set it to false"
        )


def with_backend(cfg: Config, info: DistInfo) -> DistInfo:
    """`info` with the process group's backend for this strategy: parallel.cpu_offload keeps the
    sharded state in CPU memory, so the group needs gloo for CPU tensors beside nccl (clipping's
    norm, the optimizer's step)."""
    if cfg.parallel.strategy == "fsdp" and cfg.parallel.cpu_offload and info.backend == "nccl":
        return dataclasses.replace(info, backend="cpu:gloo,cuda:nccl")
    return info


def units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded (and checkpointed) one by one: task.shard_units(model) when the seam
    names them, else (no such function, or it returns None) default_units(model). A unit sharing
    a parameter with anything outside it is a ConfigError naming the parameter."""
    named = task.shard_units(model) if hasattr(task, "shard_units") else None
    chosen = list(named) if named is not None else default_units(model)
    problem = split_parameter(model, chosen)
    if problem:
        raise ConfigError(problem)
    return chosen


def default_units(model: nn.Module) -> list[nn.Module]:
    """The children of the largest ModuleList (a transformer's blocks), else the model's children
    that hold parameters (an nn.Sequential's layers); the rest stays in the root's group. A child
    sharing a parameter with the rest (tied weights) stays there too."""

    def size(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    parent = max(lists, key=size) if lists else model
    candidates = [child for child in parent.children() if size(child) > 0]
    return [child for child in candidates if split_parameter(model, [child]) is None]


def split_parameter(model: nn.Module, chosen: list[nn.Module]) -> str | None:
    """Why `chosen` cannot be sharded as units, or None: a unit that is not a module of the model,
    named twice or nested in another, or a parameter of a unit that a module outside it also
    holds (tied weights)."""
    names = {id(module): name or "the model itself" for name, module in model.named_modules()}
    for index, unit in enumerate(chosen):
        if id(unit) not in names:
            return "task.shard_units: a unit is not a module of the model; name modules of the model it is given"
        members = {id(module) for module in unit.modules()}
        for other in chosen[index + 1 :]:
            if other is unit or id(other) in members or unit in list(other.modules()):
                return (
                    f"task.shard_units: {names[id(other)]} and {names[id(unit)]} overlap (one holds or is the other); "
                    "name disjoint modules, e.g. a model's blocks"
                )
        inside = {id(p): f"{names[id(unit)]}.{name}" for name, p in unit.named_parameters(remove_duplicate=False)}
        for name, param in model.named_parameters(remove_duplicate=False):
            owner = model.get_submodule(name.rpartition(".")[0])
            if id(param) in inside and id(owner) not in members:
                return (
                    f"sharding units: {inside[id(param)]} in unit {names[id(unit)]} is tied to {name} outside it; "
                    "put every module that holds it in one unit, or leave them all to the root (task.shard_units)"
                )
    return None


def recomputed(chosen: list[nn.Module], mode: str) -> list[int]:
    """The indices of the units whose activations are recomputed in backward: every unit (full),
    every second one (selective), or none; never a unit holding BatchNorm (a recomputed forward
    would update its running statistics twice)."""
    if mode == "none":
        return []
    return [
        index
        for index, unit in enumerate(chosen)
        if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in unit.modules())
        and (mode == "full" or index % 2 == 0)
    ]


def checkpoint_activations(chosen: list[nn.Module], mode: str) -> list[nn.Module]:
    """Recompute the activations of the units `recomputed` names in backward instead of keeping
    them. Returns the units left out for their BatchNorm."""
    if mode == "none":
        return []
    picked = recomputed(chosen, mode)
    for index in picked:
        # the instance's forward: nn.Module.__call__ (and FSDP's hooks around it) stay as they are,
        # and state_dict names do not change as they would under a wrapper module
        chosen[index].forward = partial(checkpoint, chosen[index].forward, use_reentrant=False)
    return [unit for unit in chosen if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in unit.modules())]


def shard(model: nn.Module, chosen: list[nn.Module], settings: ParallelConfig, precision: str) -> nn.Module:
    """fully_shard each BatchNorm layer (in fp32), each unit, then the root; parameters gathered in
    `precision` (train.precision)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    low = LOW_PRECISION.get(precision)
    # gathered in low precision, gradients reduced in fp32; autocast still decides each op's precision
    mixed = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    options = {
        "reshard_after_forward": settings.reshard_after_forward,
        "offload_policy": CPUOffloadPolicy() if settings.cpu_offload else OffloadPolicy(),
    }
    # every BatchNorm a group of its own in fp32, in a unit or not: its buffers stay fp32, and
    # its kernel wants weights of their type
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)] if low else []
    for norm in norms:
        fully_shard(norm, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32), **options)
    for unit in chosen:
        if unit not in norms:
            fully_shard(unit, mp_policy=mixed, **options)
    fully_shard(model, mp_policy=mixed, **options)
    return model


@contextmanager
def unreduced_parameters_named():
    """DDP's error for a parameter that a step left without a gradient names DDP's own argument:
    add this project's setting, and the command that lists such parameters."""
    try:
        yield
    except RuntimeError as error:
        if "Expected to have finished reduction in the prior iteration" in str(error):
            error.add_note(
                "parameters got no gradient on a rank (a routed model's experts on some batches): set "
                "parallel.find_unused_parameters=true, or freeze those that never get one; "
                f"`python -m {__package__.rpartition('.')[0]}.tools.diagnose unused` lists them"
            )
        raise


def micro_batch(model: nn.Module, syncs: bool, settings: ParallelConfig, info: DistInfo):
    """The context of one micro-batch's backward: only the last one of an optimizer step reduces
    gradients under DDP (no_sync before it), and under FSDP with parallel.reduce_every_micro_batch off
    (full gradients kept between micro-batches); with it on (the default) every micro-batch
    reduce-scatters, and gradients stay sharded between them."""
    if dist.sharded(model):
        model.set_requires_gradient_sync(syncs or settings.reduce_every_micro_batch)
        return nullcontext()
    return nullcontext() if syncs or not info.distributed else model.no_sync()


def clip_gradients(model: nn.Module, max_norm: float | None) -> torch.Tensor | None:
    """Scale the gradients to a global norm of at most `max_norm`; returns their norm before (on the
    device, over every shard under fsdp: the same on every rank), or None when `max_norm` is None."""
    if max_norm is None:
        return None
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # fsdp: a replicated DTensor


def static_memory_bytes(model: nn.Module, chosen: list[nn.Module], cfg: Config, world_size: int) -> int:
    """Bytes per device for weights, gradients and optimizer state (state_bytes), before
    activations; under FSDP also the gathered parameters: the largest unit's twice (the next is
    gathered ahead), or every unit's without parallel.reshard_after_forward, in the precision they are
    gathered in, and whole fp32 gradients between micro-batches without
    parallel.reduce_every_micro_batch. AMP under DDP keeps low-precision weight copies, budgeted at 4
    bytes a parameter."""
    shapes = [p.shape for p in model.parameters()]
    params = sum(math.prod(shape) for shape in shapes)
    low = cfg.train.precision in LOW_PRECISION
    if cfg.parallel.strategy == "ddp" or world_size == 1:
        return state_bytes(shapes, cfg.optim, 1) + (4 * params if low else 0)
    sizes = [sum(p.numel() for p in unit.parameters()) for unit in chosen] or [params]
    held = 2 * max(sizes) if cfg.parallel.reshard_after_forward else sum(sizes)
    whole_gradients = cfg.train.grad_accum_steps > 1 and not cfg.parallel.reduce_every_micro_batch
    gathered_bytes = held * (2 if low else 4) + (4 * params if whole_gradients else 0)
    return state_bytes(shapes, cfg.optim, world_size) + gathered_bytes


def gathered(settings: ParallelConfig, grad_accum_steps: int) -> str:
    """What the FSDP estimate adds to the 1/N share, in words."""
    extra = "the largest unit gathered" if settings.reshard_after_forward else "every unit gathered"
    if grad_accum_steps > 1 and not settings.reduce_every_micro_batch:
        extra += ", whole gradients between micro-batches"
    return extra


def state_bytes(shapes: list[torch.Size], optim: OptimConfig, shards: int) -> int:
    """Weights and gradients in fp32 (4 + 4 bytes a parameter) and the optimizer's state
    (optimizer_state_bytes) on one device: DDP holds all of it on every device (1 shard); FSDP
    splits each parameter's first dimension over the ranks (the largest share, when it does not
    divide)."""
    local = [shard_shape(shape, shards) for shape in shapes]
    return 8 * sum(math.prod(shape) for shape in local) + (optimizer_state_bytes(local, optim) or 0)


def shard_shape(shape: torch.Size, shards: int) -> tuple[int, ...]:
    """The largest share of a parameter of `shape` that FSDP2 gives a rank: its first dimension split."""
    if not shape or shards == 1:
        return tuple(shape)
    return (-(-shape[0] // shards), *shape[1:])


def optimizer_state_bytes(shapes: list[tuple[int, ...]], optim: OptimConfig) -> int | None:
    """The bytes of state optim.name's optimizer allocates at its first step for parameters of
    these shapes, in fp32: adamw two moments and a step count a parameter; sgd a momentum buffer,
    none when optim.momentum is 0; adafactor a row and a column statistic of each matrix (of its
    last two dimensions), the whole second moment of each vector, and a step count. None for
    optim.name=task, whose optimizer the task builds."""
    if optim.name == "task":
        return None
    total = 0
    for shape in shapes:
        size = math.prod(shape)
        if optim.name == "adamw":
            total += 4 * (2 * size + 1)
        elif optim.name == "sgd":
            total += 4 * size if optim.momentum else 0
        elif len(shape) >= 2:  # adafactor: factored
            total += 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1] + 1)
        else:
            total += 4 * (size + 1)
    return total
