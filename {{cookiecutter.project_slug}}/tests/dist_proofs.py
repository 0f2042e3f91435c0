"""Proofs of the distributed maths, run under torchrun (2 ranks on CPU/gloo in the tests).

    torchrun --standalone --nproc_per_node=2 tests/dist_proofs.py OUT [--only eval|fsdp|memory] [section.key=value ...]
    torchrun ... tests/dist_proofs.py OUT --resume CHECKPOINT [section.key=value ...]   # loads it exactly?

Each proof uses the project's own loop for the distributed side and, as the reference, one
plain process written here by hand. Both see the task only through its seam (task.py), so
the proofs hold for whatever model, data and loss the project trains. Rank 0 prints a
PASS/FAIL line per proof (exit code 1 if one fails) and writes OUT/proofs-<world size>.json
(fsdp-<world size>.json for `--only fsdp`, the sharded loop's proofs; memory-<world size>.json for
`--only memory`, the sharded state of the model the overrides size, after one step), on which
test_distributed.py asserts, one test per practice.
"""

from __future__ import annotations

import argparse
import copy
import errno
import json
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, Subset

# run as a script (`torchrun tests/dist_proofs.py`), it finds the project's package without installing it
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from helpers import resume, whole_checkpoint  # noqa: E402

from {{ cookiecutter.package_name }} import config, task, train  # noqa: E402
from {{ cookiecutter.package_name }}.base import dist, preemption, records  # noqa: E402
from {{ cookiecutter.package_name }}.base.across_ranks import as_one_process, gather_from_ranks, gathers_replaced  # noqa: E402
from {{ cookiecutter.package_name }}.base.batching import (
    drawn_from,  # noqa: E402
    unwrap,  # noqa: E402
)
from {{ cookiecutter.package_name }}.base.dist import DistInfo  # noqa: E402
from {{ cookiecutter.package_name }}.loop import checkpoint, loaders, optim, parallel, preflight, sharded_checkpoint  # noqa: E402
from {{ cookiecutter.package_name }}.tools import checks  # noqa: E402
from {{ cookiecutter.package_name }}.tools.checks import FAIL, PASS  # noqa: E402
from {{ cookiecutter.package_name }}.tools.smoke import CommCounter, counting_allreduce_hook  # noqa: E402

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
# of the step's largest gradient: float32 rounding, as the ranks add in another order than one process
GRADIENT_TOLERANCE = 1e-5
WEIGHTING_TOLERANCE = 1e-6
# What makes the loop's gradient differ from one process's on the same samples, weights and random draws
DRIFT = (
    "the all-reduced gradient differs from one process's on the same samples: check that task.loss_sum "
    "returns a SUM (not a mean) and count_terms counts its terms, and that the forward keeps no state "
    "across calls beyond BatchNorm's statistics"
)
TOO_FEW_SAMPLES = (
    "a rank's share of the training set is smaller than one micro-batch per accumulation step: add training "
    "samples, or pass a smaller data.batch_size after the command"
)
EXACT_MATHS = ["train.precision=fp32", "optim.lr_scaling=none", "data.num_workers=0", "parallel.sync_batchnorm=false"]
# the sharded loop's proofs: activation checkpointing on, a clip norm every step reaches, and an
# odd number of eval samples (uneven over the ranks) to keep the evaluations short
SHARDED = ["parallel.strategy=fsdp", "parallel.activation_checkpointing=full", "train.grad_clip=0.01", "eval.limit=61"]
UPDATE_TOLERANCE = 1e-5  # of the largest weight: the norm of sharded gradients sums in another order


def rank_orders(train_set, cfg, world_size: int, epoch: int) -> list[list[int]]:
    """The sample indices each rank's sampler yields in an epoch."""
    orders = []
    for rank in range(world_size):
        sampler = loaders.train_sampler(train_set, cfg.run.seed, world_size, rank)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def draw_seed(step: int, rank: int, micro_batch: int) -> int:
    """The seed of a forward's random draws (dropout, region sampling, noise) in the proofs: the
    loop's rank r draws for micro-batch k of step s what the reference draws for it."""
    return hash((step, rank, micro_batch)) % 2**32


def seeded_loss_sum(model, batch, step: int, rank: int, micro_batch: int) -> torch.Tensor:
    with drawn_from(draw_seed(step, rank, micro_batch)):
        return task.loss_sum(model, batch)


def rank_losses(model, rank_batches: list, step: int, micro_batch: int) -> list[torch.Tensor]:
    """One process's loss_sum of each rank's micro-batch, as each rank computes it: its own forward
    (BatchNorm sees that rank's samples) with that rank's random draws. For a loss that spans ranks
    (task.LOSS_SPANS_RANKS) each gather returns every rank's rows, as the loop's does: a first pass
    keeps each rank's rows, with their graphs, and the second gives every rank's loss the others'."""
    if not preflight.spans_ranks():
        with as_one_process():
            return [seeded_loss_sum(model, batch, step, rank, micro_batch) for rank, batch in enumerate(rank_batches)]
    rows = []  # rows[rank][call]: what that rank's gathers were given
    for rank, batch in enumerate(rank_batches):
        kept = []
        with gathers_replaced(lambda tensor, kept=kept: kept.append(tensor) or (tensor, 0)):
            seeded_loss_sum(model, batch, step, rank, micro_batch)
        rows.append(kept)
    losses = []
    for rank, batch in enumerate(rank_batches):
        calls = iter(range(len(rows[rank])))

        def everyone(tensor, rank=rank, calls=calls):
            call = next(calls)
            first = sum(len(rows[other][call]) for other in range(rank))
            return torch.cat([tensor if other == rank else rows[other][call] for other in range(len(rows))]), first

        with gathers_replaced(everyone):
            losses.append(seeded_loss_sum(model, batch, step, rank, micro_batch))
    return losses


def reference_gradients(model, step_batches: list[list], step: int = 0) -> None:
    """One process: the summed loss of every rank's micro-batches (step_batches[rank][micro]),
    each as its rank computes it (rank_losses), divided once by all their loss terms."""
    terms = sum(float(task.count_terms(batch)) for batches in step_batches for batch in batches)
    micro_batches = range(len(step_batches[0]))
    loss = sum(sum(rank_losses(model, [b[k] for b in step_batches], step, k)) for k in micro_batches)
    (loss / terms).backward()


def step_batches(train_set, collate, world_size: int, step: int, cfg) -> list[list]:
    """The micro-batches of one optimizer step on every rank: [rank][micro-batch] (a small
    dataset's epoch can end within the proofs' steps)."""
    per_rank, batch = cfg.data.batch_size * cfg.train.grad_accum_steps, cfg.data.batch_size
    steps_per_epoch = len(rank_orders(train_set, cfg, world_size, 0)[0]) // per_rank
    epoch, step = divmod(step, steps_per_epoch)
    orders = rank_orders(train_set, cfg, world_size, epoch)
    if hasattr(train_set, "set_epoch"):  # as train.fit does: per-epoch augmentation
        train_set.set_epoch(epoch)
    step_indices = [shard[step * per_rank : (step + 1) * per_rank] for shard in orders]
    return [
        [collate([train_set[i] for i in indices[start : start + batch]]) for start in range(0, per_rank, batch)]
        for indices in step_indices
    ]


def reference_gradient_error(cfg, world_size: int, steps: list) -> float:
    """Largest difference between the loop's gradient and one process's on the same step's
    samples from the same weights, over every step, relative to that step's largest gradient.

    Each step starts from the weights the loop had, so rounding (micro-batches and ranks add
    in another order than one backward pass) stays rounding: weights compared after several
    steps would not do, as a deep BatchNorm network at init turns a 1e-7 difference into 1e-2
    within four steps.
    """
    model = task.build_model(cfg)
    train_set, eval_set = loaders.datasets(cfg)
    collate = loaders.build_loaders(train_set, eval_set, cfg, world_of_one(), 0)[0].collate_fn
    worst = 0.0
    for step, (weights, gradients) in enumerate(steps):
        model.load_state_dict(weights)
        model.zero_grad(set_to_none=True)
        model.train()
        reference_gradients(model, step_batches(train_set, collate, world_size, step, cfg), step)
        reference = [gradient_of(p) for p in model.parameters()]
        largest = max(g.abs().max().item() for g in reference)
        error = max((zeros_if_none(g, r) - r).abs().max().item() for g, r in zip(gradients, reference, strict=True))
        worst = max(worst, error / largest)
    return worst


@contextmanager
def forwards_seeded(info: DistInfo):
    """The loop's forwards draw as the reference's do: micro-batch k of optimizer step s on rank r
    from draw_seed(s, r, k), counting the steps from the first one in it."""
    train_step, loss_sum, position = train.train_step, task.loss_sum, {"step": 0, "micro": 0}

    def step_counted(job, micro_batches, cfg, info_):
        position["micro"] = 0
        try:
            return train_step(job, micro_batches, cfg, info_)
        finally:
            position["step"] += 1

    def loss_sum_seeded(model, batch):
        with drawn_from(draw_seed(position["step"], info.rank, position["micro"])):
            position["micro"] += 1
            return loss_sum(model, batch)

    train.train_step, task.loss_sum = step_counted, loss_sum_seeded
    try:
        yield
    finally:
        train.train_step, task.loss_sum = train_step, loss_sum


@contextmanager
def steps_recorded(steps: list):
    """Keep, at each optimizer step of the loop, its weights and the gradient it is about to clip
    and apply (the step clips, or not, at parallel.clip_gradients)."""
    clip_gradients = parallel.clip_gradients

    def recording(model, max_norm):
        gradients = [None if p.grad is None else whole(p.grad).detach().clone() for p in model.parameters()]
        steps.append((whole_weights(model), gradients))  # None stays None: the optimizer skips such a parameter
        return clip_gradients(model, max_norm)

    parallel.clip_gradients = recording
    try:
        yield
    finally:
        parallel.clip_gradients = clip_gradients


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered whole (every rank must call it); a plain one as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def gradient_of(param: torch.Tensor) -> torch.Tensor:
    """The whole gradient of `param`; zeros where the loss did not reach it (a routed model's
    expert that no token of the batch chose)."""
    return zeros_if_none(whole(param.grad) if param.grad is not None else None, whole(param))


def zeros_if_none(gradient: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if gradient is None else gradient


def whole_weights(model) -> dict:
    return {name: whole(value).detach().clone() for name, value in unwrap(model).state_dict().items()}


def world_of_one() -> DistInfo:
    return DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")


def exact_config(out: Path, overrides: list[str], *extra: str):
    return config.load(SMOKE, [*EXACT_MATHS, *overrides, f"run.out_dir={out}", "checkpoint.resume=never", *extra])


def fitting_batch(cfg, world_size: int, accum: int) -> int:
    """data.batch_size, or less where a rank's share of the training set holds fewer than `accum`
    batches of it: the proofs hold at any batch size. 0 where not even one sample a micro-batch fits."""
    per_rank = len(loaders.datasets(cfg)[0]) // world_size
    return min(cfg.data.batch_size, per_rank // accum)


def prove_ddp_equals_big_batch(out: Path, overrides: list[str], info: DistInfo, accum: int, steps: int) -> dict:
    settings = [f"run.name=accum{accum}", f"train.grad_accum_steps={accum}", f"train.max_steps={steps}"]
    batch = fitting_batch(exact_config(out, overrides, *settings), info.world_size, accum)
    if batch == 0:
        return {"steps": 0, "gradient_error": 0.0, "update_error": 0.0, "buckets_per_sync": [], "micro_batches": 0}
    cfg = exact_config(out, overrides, *settings, f"data.batch_size={batch}")
    job = train.build(cfg, info)
    counter, recorded = CommCounter(), []
    if not dist.sharded(job.model):
        job.model.register_comm_hook(counter, counting_allreduce_hook)
    with forwards_seeded(info), steps_recorded(recorded), train.training_log(job, cfg, info) as log:
        train.fit(job, cfg, info, log, preemption.PreemptionFlag(signals=()))
    update = reference_update_error(cfg, job, recorded, whole_weights(job.model))
    measured = dist.sharded(job.model) and accum == 1  # the sharded run's evaluation and memory, once
    evaluation = sharded_evaluation(job, cfg, info) | held_bytes(job, cfg, info) if measured else {}
    return evaluation | {
        "gradient_error": reference_gradient_error(cfg, info.world_size, recorded),
        "update_error": update,
        # after the run's last evaluation: each rank's buffers (BatchNorm statistics of its own batches) or rank 0's
        "buffers": dist.all_gather_objects([buffer.double().sum().item() for buffer in job.model.buffers()]),
        "steps": job.state.step,
        "buckets_per_sync": counter.buckets_per_sync,
        "micro_batches": steps * accum,
        "batch_size": batch,
    }


def reference_update_error(cfg, job: train.Job, steps: list, final_weights: dict) -> float:
    """Largest difference between the loop's weights after its steps and those of one plain
    model that the same clipping, optimizer and schedule move with the loop's gradients, relative
    to the largest weight: under FSDP each rank updates its shard, and the whole must be the
    update of the whole."""
    model = task.build_model(cfg)
    model.load_state_dict(steps[0][0])
    warmup = optim.warmup_fraction(cfg.schedule.warmup_fraction, job.global_batch, cfg.optim.reference_batch_size)
    optimizer = optim.build_optimizer(model, cfg, job.state.optimizer.param_groups[0]["initial_lr"])
    scheduler = optim.build_scheduler(optimizer, cfg, job.total_steps, warmup)
    for _, gradients in steps:
        for param, gradient in zip(model.parameters(), gradients, strict=True):
            param.grad = None if gradient is None else gradient.clone()
        parallel.clip_gradients(model, cfg.train.grad_clip)  # the scaler is off: nothing to unscale
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    params = dict(model.named_parameters())
    largest = max(final_weights[name].abs().max().item() for name in params)
    return max((final_weights[name] - param).abs().max().item() for name, param in params.items()) / largest


def sharded_evaluation(job: train.Job, cfg, info: DistInfo) -> dict:
    """The sharded model's evaluation, and one plain process's with the same whole weights
    (rank 0's BatchNorm statistics, which the loop's evaluation broadcasts first): every rank
    evaluates alone for the latter, in a world of one."""
    ours = train.evaluate(job.model, job.eval_loader, cfg, info, job.reference_loader)
    model = task.build_model(cfg)
    model.load_state_dict(whole_weights(job.model))
    train_set, eval_set = loaders.datasets(cfg)
    eval_loader = loaders.build_loaders(train_set, eval_set, cfg, world_of_one(), 0)[1]
    reference = loaders.reference_loader(train_set, cfg, world_of_one(), 0)
    alone = train.evaluate(model, eval_loader, cfg, world_of_one(), reference)
    return {"evaluation": ours, "evaluation_alone": alone, "eval_set": len(eval_set)}


def held_bytes(job: train.Job, cfg, info: DistInfo) -> dict:
    """This rank's bytes of weights, gradients (as many as the weights' shards: reduce-scattered
    in fp32) and optimizer state, with the estimate the start-up line prints and DDP's."""
    local = [p.to_local() for p in job.model.parameters()]
    weights = sum(t.numel() * t.element_size() for t in local)
    states = [value for state in job.state.optimizer.state.values() for value in state.values()]
    optimizer = sum(
        v.to_local().numel() * v.element_size() if hasattr(v, "to_local") else v.numel() * v.element_size()
        for v in states
        if isinstance(v, torch.Tensor) and v.dim() > 0  # AdamW's step counts are scalars
    )
    shapes = [p.shape for p in job.model.parameters()]
    return {
        "held_bytes": dist.all_gather_objects(2 * weights + optimizer),
        "estimated_bytes": parallel.state_bytes(shapes, cfg.optim, info.world_size),
        "ddp_bytes": parallel.state_bytes(shapes, cfg.optim, 1),
        "estimated_units": len(job.units),  # the units the start-up estimate adds gathered
    }


def prove_memory(out: Path, overrides: list[str], info: DistInfo) -> dict:
    """The bytes each rank holds after one sharded step of the model `overrides` size, as estimated."""
    cfg = exact_config(out, [*SHARDED, *overrides], "run.name=memory", "train.max_steps=1")
    job = train.build(cfg, info)
    with train.training_log(job, cfg, info) as log:
        train.fit(job, cfg, info, log, preemption.PreemptionFlag(signals=()))
    return held_bytes(job, cfg, info) | {"parameters": sum(p.numel() for p in job.model.parameters())}


def prove_sharding(overrides: list[str], info: DistInfo) -> dict:
    """What wrap did under parallel.strategy=fsdp: every unit and the root sharded, every parameter
    a shard, each unit's activations recomputed."""
    cfg = config.load(SMOKE, [*SHARDED, *overrides])
    model = task.build_model(cfg)
    units = parallel.units(model)  # of the model as built: fully_shard changes the units' classes
    model = train.wrap(model, cfg, info)
    return {
        "units": len(units),
        "units_sharded": sum(dist.sharded(unit) for unit in units),
        "root_sharded": dist.sharded(model),
        "parameters_sharded": all(hasattr(p, "full_tensor") for p in model.parameters()),
        "units_recomputed": sum(getattr(unit.forward, "func", None) is parallel.checkpoint for unit in units),
        "units_with_batchnorm": sum(
            any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in unit.modules()) for unit in units
        ),
    }


def prove_sharded(out: Path, overrides: list[str], info: DistInfo) -> dict:
    sharded = [*SHARDED, *overrides]
    whole_gradients = [*sharded, "parallel.reduce_every_micro_batch=false"]
    return {
        "world_size": info.world_size,
        "equivalence": prove_ddp_equals_big_batch(out / "fsdp", sharded, info, accum=1, steps=3),
        "accumulation": prove_ddp_equals_big_batch(out / "fsdp", sharded, info, accum=4, steps=2),
        "accumulation_whole": prove_ddp_equals_big_batch(out / "fsdp-whole", whole_gradients, info, accum=4, steps=2),
        "sharding": prove_sharding(overrides, info),
        "recompute": prove_recompute_with_dropout(info, "fsdp"),
        "settings": prove_fsdp_settings(out / "fsdp-settings", overrides, info),
    }


def prove_unequal_terms_are_weighted_globally(out: Path, overrides: list[str], info: DistInfo) -> dict:
    """Ranks hold batches of different sizes (and so different numbers of loss terms); the
    loop's gradient must still equal one process on their union."""
    task.TERMS_PER_SAMPLE = None  # the count-free path assumes equal batches, which this proof breaks on purpose
    cfg = exact_config(out, overrides, "run.name=weighting")
    sizes = unequal_sizes(info.world_size)
    if len(loaders.datasets(cfg)[0]) < sum(sizes):
        return {"terms": [], "unreduced": f"the training set holds fewer than the {sum(sizes)} samples this proof uses"}
    job = train.build(cfg, info)
    reference = copy.deepcopy(unwrap(job.model))
    batches = unequal_batches(cfg, job.train_loader.collate_fn, info.world_size)
    terms = [float(task.count_terms(b)) for b in batches]
    reference.train()
    unreduced = unreduced_parameters(reference, batches, cfg)  # every rank finds the same: no collective
    if unreduced:
        return {"terms": terms, "unreduced": unreduced}
    job.model.train()
    recorded = []
    with forwards_seeded(info), steps_recorded(recorded):
        train.train_step(job, [batches[info.rank]], cfg, info)
    loop_gradients = [zeros_if_none(g, whole(p)) for g, p in zip(recorded[0][1], job.model.parameters(), strict=True)]
    reference.zero_grad(set_to_none=True)
    reference_gradients(reference, [[batch] for batch in batches])
    mean_of_means = copy.deepcopy(reference)
    mean_of_means.zero_grad(set_to_none=True)
    losses = rank_losses(mean_of_means, batches, 0, 0)
    sum(loss / terms for loss, terms in zip(losses, terms, strict=True)).div(len(batches)).backward()
    gradients = [loop_gradients, *(list(map(gradient_of, m.parameters())) for m in (reference, mean_of_means))]
    pairs = list(zip(*gradients, strict=True))
    return {
        "terms": terms,
        "max_difference": max((a - b).abs().max().item() for a, b, _ in pairs),
        "mean_of_means_difference": max((b - c).abs().max().item() for _, b, c in pairs),
    }


def unequal_sizes(world_size: int) -> list[int]:
    return [3 + 5 * rank for rank in range(world_size)]


def unequal_batches(cfg, collate, world_size: int) -> list:
    """A batch for each rank, of 3, 8, 13 ... samples."""
    train_set, _ = loaders.datasets(cfg)
    sizes = unequal_sizes(world_size)
    starts = [sum(sizes[:rank]) for rank in range(world_size)]
    indices = [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]
    return [collate([train_set[i] for i in chosen]) for chosen in indices]


def unreduced_parameters(model, batches: list, cfg) -> str | None:
    """What the loop could not reduce, when some rank's batch leaves trainable parameters without a
    gradient (a routed model's experts that no token chose): DDP without find_unused_parameters
    waits for them forever, and FSDP2 reduce-scatters a different set on each rank (pytorch#158719)."""
    if len(batches) == 1:  # one process: nothing to reduce
        return None
    missing = []
    for rank, batch in enumerate(batches):
        model.zero_grad(set_to_none=True)
        with as_one_process():  # a loss that spans ranks: the gradients of this rank's own forward
            seeded_loss_sum(model, batch, 0, rank, 0).backward()
        missing.append({name for name, p in model.named_parameters() if p.requires_grad and p.grad is None})
    model.zero_grad(set_to_none=True)
    rank, names = next(((rank, sorted(names)) for rank, names in enumerate(missing) if names), (None, []))
    sharded = cfg.parallel.strategy == "fsdp"
    reduced = all(m == missing[0] for m in missing) if sharded else cfg.parallel.find_unused_parameters
    if not names or reduced:
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    where = f"rank {rank}'s {unequal_sizes(len(batches))[rank]} samples leave {shown} without a gradient"
    if sharded:
        return (
            f"{where}, other ranks' do not: FSDP2 reduce-scatters only the gradients a rank has (pytorch#158719); "
            "run each expert on its empty selection instead of skipping it, or train it with parallel.strategy=ddp"
        )
    return f"{where}: DDP would wait for them; set parallel.find_unused_parameters=true (`diagnose unused` lists them)"


def prove_same_initial_weights(overrides: list[str]) -> dict:
    cfg = config.load(SMOKE, overrides)
    dist.seed_everything(cfg.run.seed)
    checksum = sum(p.double().sum().item() for p in task.build_model(cfg).parameters())
    return {"checksums": dist.all_gather_objects(checksum)}


@contextmanager
def datasets_replaced(make):
    """The run's datasets as `make(train_set, eval_set)` returns them, through the seam (or the shards)."""
    datasets = loaders.datasets
    loaders.datasets = lambda cfg: make(*datasets(cfg))
    try:
        yield
    finally:
        loaders.datasets = datasets


def prove_unequal_lengths_stop_the_build(out: Path, overrides: list[str], info: DistInfo) -> dict:
    """A rank whose training set is shorter (another copy of the data on its node) would run
    fewer steps and leave the others waiting in an all-reduce: train.build stops every rank."""
    cfg = exact_config(out, overrides, "run.name=unequal")
    short = 2 * cfg.data.batch_size * info.world_size * info.rank  # rank r: 2r batches fewer

    def shorter_on_later_ranks(train_set, eval_set):
        return Subset(train_set, range(len(train_set) - short)), eval_set

    try:
        with datasets_replaced(shorter_on_later_ranks):
            train.build(cfg, info)
    except RuntimeError as err:
        message = str(err)
    else:
        message = ""
    return {"messages": dist.all_gather_objects(message)}


class Recorded(Dataset):
    """The first `size` samples of a dataset, keeping the index of every sample read."""

    def __init__(self, dataset, size: int):
        self.dataset, self.size, self.read = dataset, size, []

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        self.read.append(index)
        return self.dataset[index]

    def __getattr__(self, name: str):  # set_epoch, when the task's dataset has one
        return getattr(self.__dict__["dataset"], name)


def prove_epochs_reshuffle(out: Path, overrides: list[str], info: DistInfo, epochs: int = 3) -> dict:
    """The order each rank reads its shard in, epoch by epoch, in the loop's own run."""
    settings = ["run.name=epochs", "train.max_steps=null", f"train.epochs={epochs}", "train.grad_accum_steps=1"]
    batch = fitting_batch(exact_config(out, overrides, *settings), info.world_size, 2)
    cfg = exact_config(out, overrides, *settings, f"data.batch_size={max(batch, 1)}")
    per_epoch = 2 * cfg.data.batch_size  # each rank's shard: two steps an epoch
    datasets = {}

    def recorded(train_set, eval_set):
        datasets["train"] = Recorded(train_set, per_epoch * info.world_size)
        return datasets["train"], Subset(eval_set, range(info.world_size))

    with datasets_replaced(recorded):
        job = train.build(cfg, info)
    datasets["train"].read.clear()  # the start-up checks read a few samples
    with train.training_log(job, cfg, info) as log:
        train.fit(job, cfg, info, log, preemption.PreemptionFlag(signals=()))
    read = datasets["train"].read
    return {"orders": dist.all_gather_objects([read[e * per_epoch : (e + 1) * per_epoch] for e in range(epochs)])}


def prove_wrapping(overrides: list[str], info: DistInfo) -> dict:
    cfg = config.load(SMOKE, [*overrides, "parallel.bucket_cap_mb=7"])
    model = train.wrap(task.build_model(cfg), cfg, info)
    return {
        "is_ddp": isinstance(model, DDP),
        "eval_model_is_unwrapped": not isinstance(dist.without_ddp(model), DDP),
        "gradient_as_bucket_view": model.gradient_as_bucket_view,
        "find_unused_parameters": model.find_unused_parameters,
        "bucket_bytes_cap": model.bucket_bytes_cap,
    }


def uneven_batch(size: int, batch_size: int) -> int:
    """The largest batch size up to `batch_size` that cuts `size` samples into a number of batches
    neither 2 nor 3 ranks split evenly, so that some rank repeats a batch (not counted), whatever the
    world size the proof runs on: the same batches on 1, 2 and 3 ranks."""
    fits = [b for b in range(batch_size, 0, -1) if -(-size // b) % 2 and -(-size // b) % 3]
    return fits[0] if fits else batch_size


def prove_eval_counts(overrides: list[str], info: DistInfo) -> dict:
    cfg = config.load(SMOKE, [*overrides, "data.num_workers=0"])
    batch = uneven_batch(len(loaders.datasets(cfg)[1]), cfg.data.batch_size)
    cfg = config.load(SMOKE, [*overrides, "data.num_workers=0", f"data.batch_size={batch}"])
    dist.seed_everything(cfg.run.seed)
    model = task.build_model(cfg)
    train_set, eval_set = loaders.datasets(cfg)
    _, eval_loader = loaders.build_loaders(train_set, eval_set, cfg, info, 0)
    reference = loaders.reference_loader(train_set, cfg, info, 0)
    return train.evaluate(model, eval_loader, cfg, info, reference) | {"dataset_size": len(eval_set)}


def verdicts(results: dict) -> list[checks.Row]:
    """One row per proof that `results` holds, judged as test_distributed.py judges it."""
    evaluation = results["eval"]
    counted = f"{evaluation['eval_samples']} samples of {evaluation['dataset_size']}"
    rows = [(PASS if evaluation["eval_samples"] == evaluation["dataset_size"] else FAIL, "eval counts", counted)]
    if "equivalence" not in results:
        return rows
    for name, what in (("equivalence", "DDP == 1 process"), ("accumulation", "no_sync == big batch")):
        error, steps = results[name]["gradient_error"], results[name]["steps"]
        detail = f"gradient differs by {error:.1e} of the largest ({steps} steps)"
        if name == "accumulation" and results.get("spans_ranks"):
            detail += "; the loss spans ranks: a micro-batch's terms see that micro-batch of every rank"
        if steps == 0:  # nothing compared proves nothing
            rows.append((FAIL, what, f"no optimizer step ran; {TOO_FEW_SAMPLES}"))
        else:
            rows.append((PASS, what, detail) if error < GRADIENT_TOLERANCE else (FAIL, what, drifted(detail, results)))
    syncs = len(results["accumulation"]["buckets_per_sync"])
    steps = results["accumulation"]["steps"]
    counted = PASS if syncs == steps > 0 else FAIL
    rows.append((counted, "1 all-reduce per step", f"{syncs} for {steps} optimizer steps"))
    weighting = results["weighting"]
    if "unreduced" in weighting:
        rows.append((FAIL, "global loss weighting", weighting["unreduced"]))
    else:
        fair = weighting["max_difference"] < WEIGHTING_TOLERANCE
        detail = f"terms {weighting['terms']}: gradient differs by {weighting['max_difference']:.1e}"
        rows.append((PASS if fair else FAIL, "global loss weighting", detail))
    same = len(set(results["initial_weights"]["checksums"])) == 1
    rows.append((PASS if same else FAIL, "same initial weights", "on every rank" if same else "ranks differ"))
    stopped = all("loader length differs" in message for message in results["unequal_lengths"]["messages"])
    outcome = "every rank raises" if stopped else "a rank ran on"
    rows.append((PASS if stopped else FAIL, "unequal loaders stop", outcome))
    rows.append(reshuffle_verdict(results["epochs"]["orders"]))
    wrapping = results["wrapping"]
    wrapped = wrapping["is_ddp"] and wrapping["eval_model_is_unwrapped"]
    rows.append((PASS if wrapped else FAIL, "DDP wrapping", "train in DDP, evaluate unwrapped"))
    return rows


def drifted(detail: str, results: dict) -> str:
    """A failed gradient proof's detail, with what drift_causes found, or the causes to look for."""
    return f"{detail}; {'; '.join(results.get('causes') or [DRIFT])}"


def drift_causes(overrides: list[str]) -> list[str]:
    """What probes of the task find that makes one process's gradient differ from the loop's: a
    mean where the loop needs a sum (the batch given twice has the same loss, not twice it), or
    state the forward changes beyond BatchNorm's statistics (which each side then sees otherwise)."""
    ratio, changed = probe_task(overrides)
    causes = []
    if abs(ratio - 1) < 0.25:
        causes.append(
            f"task.loss_sum looks like a mean: the same samples given twice gave {ratio:.2f} times their loss, "
            "where a sum gives 2 (multiply a mean by count_terms(batch))"
        )
    if changed:
        causes.append(
            f"the forward changes the model's state ({', '.join(changed[:3])}): the loop's ranks and the reference "
            "see it at other points; keep such state out of the forward the proofs run"
        )
    return causes


def probe_task(overrides: list[str]) -> tuple[float, list[str]]:
    """The loss of 4 samples given twice over their loss given once (2 for a sum of per-sample terms;
    other values where terms see each other, e.g. contrastive negatives), and the buffers other than
    BatchNorm's statistics that the forward changed."""
    cfg = config.load(SMOKE, [*EXACT_MATHS, *overrides])
    model = task.build_model(cfg).train()
    train_set, eval_set = loaders.datasets(cfg)
    collate = loaders.build_loaders(train_set, eval_set, cfg, world_of_one(), 0)[0].collate_fn
    samples = [train_set[i] for i in range(min(4, len(train_set)))]
    statistics = {
        f"{name}.{buffer}" if name else buffer
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
        for buffer, _ in module.named_buffers(recurse=False)
    }
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    with torch.no_grad(), as_one_process():
        once = float(seeded_loss_sum(model, collate(samples), 0, 0, 0))
        twice = float(seeded_loss_sum(model, collate(samples + samples), 0, 0, 0))
    changed = [
        name
        for name, buffer in model.named_buffers()
        if name not in statistics and (name not in before or not torch.equal(buffer, before[name]))
    ]
    return (twice / once if once else float("nan")), changed


def sharded_verdicts(results: dict) -> list[checks.Row]:
    """One row per proof of the sharded loop (`--only fsdp`)."""
    rows = []
    for name, what in (
        ("equivalence", "FSDP == 1 process"),
        ("accumulation", "FSDP accumulation"),
        ("accumulation_whole", "FSDP accumulation, whole gradients"),
    ):
        result = results[name]
        error, update, steps = result["gradient_error"], result["update_error"], result["steps"]
        detail = f"gradient {error:.1e}, update {update:.1e} of the largest ({steps} steps)"
        held = steps > 0 and error < GRADIENT_TOLERANCE and update < UPDATE_TOLERANCE
        failed = drifted(detail, results) if steps else TOO_FEW_SAMPLES
        rows.append((PASS, what, detail) if held else (FAIL, what, failed))
    result = results["equivalence"]
    counted = result["evaluation"]["eval_samples"] == result["eval_set"]
    alike = metrics_alike(result["evaluation"], result["evaluation_alone"])
    detail = f"{result['evaluation']['eval_samples']} samples of {result['eval_set']}, the metrics of one process"
    rows.append((PASS if counted and alike else FAIL, "FSDP evaluation", detail))
    shard = results["sharding"]
    wrapped = shard["root_sharded"] and shard["parameters_sharded"] and shard["units_sharded"] == shard["units"] > 0
    wrapped = wrapped and results["equivalence"]["estimated_units"] == shard["units"]
    recomputed = shard["units_recomputed"] + shard["units_with_batchnorm"] == shard["units"]
    detail = f"{shard['units_sharded']} of {shard['units']} units and the root; {shard['units_recomputed']} recompute"
    detail += f"; the start-up estimate counts {results['equivalence']['estimated_units']}"
    rows.append((PASS if wrapped and recomputed else FAIL, "FSDP wrapping", detail))
    return [*rows, memory_verdict(results["equivalence"])]


def memory_verdict(result: dict) -> checks.Row:
    """Each rank holds about 1/N of DDP's weights, gradients and optimizer state, as estimated."""
    held, estimate, whole = max(result["held_bytes"]), result["estimated_bytes"], result["ddp_bytes"]
    share, off = held / whole, abs(estimate - held) / held
    detail = f"{held / 2**10:.0f} KiB a rank: {share:.2f} of DDP's, estimate off by {off:.1%}"
    fits = share <= 1 / len(result["held_bytes"]) + 0.05 and off <= 0.1
    return (PASS if fits else FAIL), "FSDP memory", detail


def metrics_alike(ours: dict, alone: dict) -> bool:
    """The same metrics within fp32 rounding (sums taken in another order), sample counts aside."""
    names = [name for name in alone if name != records.EVAL_SAMPLES]
    return ours.keys() == alone.keys() and all(abs(ours[k] - alone[k]) <= 1e-6 * max(1.0, abs(alone[k])) for k in names)


def reshuffle_verdict(orders: list[list[list[int]]]) -> checks.Row:
    """Each epoch splits the samples over the ranks, in a new order on every rank."""
    what = "new order every epoch"
    for epoch, ranks in enumerate(zip(*orders, strict=True)):
        indices = [index for shard in ranks for index in shard]
        if len(set(indices)) != len(indices):
            return FAIL, what, f"epoch {epoch}: ranks read the same sample"
    repeats = [rank for rank, epochs in enumerate(orders) if len({tuple(order) for order in epochs}) < len(epochs)]
    if repeats:
        return FAIL, what, f"rank {repeats[0]} reads an epoch in an order it read before: is sampler.set_epoch called?"
    return PASS, what, f"{len(orders[0])} epochs on {len(orders)} ranks, each read once"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", choices=["eval", "fsdp", "memory"], default=None)
    parser.add_argument("--resume", type=Path, default=None, help="prove that this checkpoint loads exactly")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    args.out.mkdir(parents=True, exist_ok=True)
    info = DistInfo.from_env()
    threads = threads_not_from_python()
    code = dist.run_in_group(info, 1, lambda: prove(args, info))
    # the teardown proof, per rank: the process group's threads are joined before Python shuts down
    record = {"before_init": threads, "after_teardown": threads_not_from_python()}
    (args.out / f"threads-rank{info.rank}.json").write_text(json.dumps(record))
    return code


def threads_not_from_python() -> int:
    """This process's threads that Python's threading module did not start (gloo's, for one)."""
    return len(list(Path("/proc/self/task").iterdir())) - threading.active_count()


def prove_resume(out: Path, overrides: list[str], info: DistInfo, path: Path) -> dict:
    """Load `path` into the loop's model and optimizer, as the run's settings build them (any
    strategy, any world size), and gather their whole state back: is it the file's, bit for bit?"""
    cfg = exact_config(out, overrides, "run.name=resumed")
    job = train.build(cfg, info)
    resume(job.model, job.state, cfg.run_dir, str(path), info, config.to_dict(cfg))
    weights, optimizer = checkpoint.full_state(job.model, job.state.optimizer)
    if not info.is_main:
        return {}
    saved = whole_checkpoint(checkpoint.find(path, weights=False)[0])  # the file, or a run directory's newest
    differ = [name for name, value in weights.items() if not torch.equal(value, saved["model"][name])]
    for name, state in saved["optimizer"]["state"].items():
        ours = optimizer["state"][name]
        differ += [f"{name}.{key}" for key, value in state.items() if not torch.equal(ours[key], value)]
    return {"differ": differ, "names": len(weights), "strategy": cfg.parallel.strategy, "world_size": info.world_size}


# ---- Activation checkpointing with dropout, and the fsdp settings' effects --------------------
# Results in the JSON only (no verdict row): test_distributed.py asserts on them.


class DropoutBlocks(torch.nn.Module):
    """A stand-in with active dropout inside its units (none of the shipped models has any at the
    test sizes): residual blocks in a ModuleList, which parallel.default_units takes as its units."""

    def __init__(self, width: int = 16, blocks: int = 3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Dropout(0.5), torch.nn.GELU())
            for _ in range(blocks)
        )
        self.head = torch.nn.Linear(width, 3)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            inputs = inputs + block(inputs)
        return self.head(inputs)


def prove_recompute_with_dropout(info: DistInfo, strategy: str) -> dict:
    """The stand-in's reduced gradients with parallel.activation_checkpointing full and selective, and
    with none under other dropout masks, against none's: the largest differences. It is wrapped as
    train.wrap wraps a model for `strategy` (checkpointing, then DDP or fully_shard), with its own
    units: a foreign model never reaches the task's shard_units."""
    cfg = config.load(SMOKE, ["train.precision=fp32", f"parallel.strategy={strategy}"])
    inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(info.rank))  # each rank its batch

    def gradients(mode: str, dropout_seed: int) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = DropoutBlocks()
        units = parallel.default_units(model)
        parallel.checkpoint_activations(units, mode)
        model = parallel.shard(model, units, cfg.parallel, cfg.train.precision) if strategy == "fsdp" else DDP(model)
        torch.manual_seed(dropout_seed)  # the same masks on every rank, each on its own batch
        model(inputs).square().sum().backward()
        return [whole(p.grad) for p in model.parameters()]

    plain = gradients("none", 7)

    def difference(grads: list[torch.Tensor]) -> float:
        return max((a - b).abs().max().item() for a, b in zip(grads, plain, strict=True))

    return {
        "other_masks": difference(gradients("none", 8)),
        "full": difference(gradients("full", 7)),
        "selective": difference(gradients("selective", 7)),
    }


def prove_gather_gradients(info: DistInfo) -> dict:
    """gather_from_ranks in a loss over every rank's rows (each row's log-sum-exp against all of
    them), rank r holding 2 + r rows: each rank's gradient of its own rows, against one process's
    gradient of the same loss over the union. The largest difference over the ranks, and where
    each rank's rows start."""
    generator = torch.Generator().manual_seed(0)
    union = torch.randn(sum(2 + r for r in range(info.world_size)), 3, dtype=torch.float64, generator=generator)
    start = sum(2 + r for r in range(info.rank))
    mine = union[start : start + 2 + info.rank].clone().requires_grad_()
    everyone, first = gather_from_ranks(mine)
    torch.logsumexp(everyone[first : first + len(mine)] @ everyone.T, dim=1).sum().backward()
    whole = union.clone().requires_grad_()
    torch.logsumexp(whole @ whole.T, dim=1).sum().backward()
    error = torch.tensor([(mine.grad - whole.grad[start : start + len(mine)]).abs().max().item()])
    firsts = [torch.zeros(1, dtype=torch.long) for _ in range(info.world_size)]
    torch.distributed.all_gather(firsts, torch.tensor([first]))
    torch.distributed.all_reduce(error, op=torch.distributed.ReduceOp.MAX)
    return {"gradient_error": error.item(), "firsts": [int(f) for f in firsts]}


def prove_fsdp_settings(out: Path, overrides: list[str], info: DistInfo) -> dict:
    """What parallel.reshard_after_forward and parallel.reduce_every_micro_batch do to the task's model as
    train.wrap shards it: after the forward pass of a micro-batch that is not an optimizer step's
    last, whether the units' parameters are still gathered (plain tensors, not shards); after its
    backward, whether gradients were reduce-scattered (a parameter has one)."""
    results = {}
    for reshard in (True, False):
        for every in (True, False):
            settings = [f"parallel.reshard_after_forward={reshard}", f"parallel.reduce_every_micro_batch={every}"]
            cfg = exact_config(out, [*SHARDED, *overrides], *settings, "train.grad_accum_steps=2")
            model = train.wrap(task.build_model(cfg), cfg, info)
            train_loader, _ = loaders.build_loaders(*loaders.datasets(cfg), cfg, info, 0)
            batch = task.to_device(next(iter(train_loader)), info.device)
            with parallel.micro_batch(model, False, cfg.parallel, info):
                loss = task.loss_sum(model, batch)
                units = parallel.units(unwrap(model))
                gathered = all(not hasattr(p, "full_tensor") for unit in units for p in unit.parameters())
                loss.backward()
            reduced = all(p.grad is not None for p in model.parameters())
            results[f"reshard={reshard},every={every}"] = {"gathered_after_forward": gathered, "reduced": reduced}
    return results


def prove_failed_background_write(out: Path, overrides: list[str], info: DistInfo) -> dict:
    """Rank 1's background write of a sharded checkpoint meets a full disk (DCP's file storage
    raises there, on that rank only); the next save must raise on every rank, nothing published:
    what each rank raised, and the checkpoints on disk."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    sharded = ("checkpoint.format=sharded", "checkpoint.async_save=true")
    cfg = exact_config(out, overrides, "run.name=failed-write", *sharded)
    job = train.build(cfg, info)
    create_stream = FileSystem.create_stream

    @contextmanager
    def full_disk(self, path, mode):
        if info.rank == 1 and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        with create_stream(self, path, mode) as stream:
            yield stream

    FileSystem.create_stream = full_disk
    raised = ""
    try:
        job.state.step = 1
        train.save_checkpoint(job, cfg, info)  # in the background: returns before the write ends
        job.state.step = 2
        train.save_checkpoint(job, cfg, info)  # waits for the first, which failed on rank 1
    except RuntimeError as err:
        raised = str(err)
    finally:
        FileSystem.create_stream = create_stream
        sharded_checkpoint.WRITES.close(cfg.dist.timeout_minutes)
    published = [path.name for path in cfg.run_dir.saved_checkpoints()]
    return {"raised": dist.all_gather_objects(raised), "published": published}


def with_causes(results: dict, overrides: list[str]) -> dict:
    """Whether the loss spans ranks, and, where a gradient proof failed, what drift_causes finds (on
    every rank alike: no collective)."""
    failed = any(
        results[name]["gradient_error"] >= GRADIENT_TOLERANCE
        for name in ("equivalence", "accumulation", "accumulation_whole")
        if name in results
    )
    return {"spans_ranks": preflight.spans_ranks(), "causes": drift_causes(overrides) if failed else []}


def prove(args: argparse.Namespace, info: DistInfo) -> int:
    if args.resume is not None:
        result = prove_resume(args.out, args.overrides, info, args.resume)
        if info.is_main:
            (args.out / "resume.json").write_text(json.dumps(result))
        return 0
    if args.only in ("fsdp", "memory"):
        sharded = args.only == "fsdp"
        results = (prove_sharded if sharded else prove_memory)(args.out, args.overrides, info)
        if sharded:
            results |= with_causes(results, args.overrides)
        rows = sharded_verdicts(results) if sharded else [memory_verdict(results)]
        if info.is_main:
            (args.out / f"{args.only}-{info.world_size}.json").write_text(json.dumps(results))
            print(checks.table(f"{args.only} proofs on {info.world_size} ranks", rows), flush=True)
        return checks.exit_code(rows)
    results = {"world_size": info.world_size, "eval": prove_eval_counts(args.overrides, info)}
    if args.only is None:
        results |= {
            "equivalence": prove_ddp_equals_big_batch(args.out, args.overrides, info, accum=1, steps=6),
            "accumulation": prove_ddp_equals_big_batch(args.out, args.overrides, info, accum=4, steps=4),
            "weighting": prove_unequal_terms_are_weighted_globally(args.out, args.overrides, info),
            "initial_weights": prove_same_initial_weights(args.overrides),
            "unequal_lengths": prove_unequal_lengths_stop_the_build(args.out, args.overrides, info),
            "epochs": prove_epochs_reshuffle(args.out, args.overrides, info),
            "wrapping": prove_wrapping(args.overrides, info),
            "recompute": prove_recompute_with_dropout(info, "ddp"),
            "gather": prove_gather_gradients(info),
        }
        if not sharded_checkpoint.floor_problem():  # background writes are sharded: torch>=2.8
            results["failed_write"] = prove_failed_background_write(args.out, args.overrides, info)
        results |= with_causes(results, args.overrides)
    rows = verdicts(results)
    if info.is_main:
        (args.out / f"proofs-{info.world_size}.json").write_text(json.dumps(results))
        print(checks.table(f"proofs on {info.world_size} ranks", rows), flush=True)
    return checks.exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
