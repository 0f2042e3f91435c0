"""Train with DistributedDataParallel.

    python -m {{ cookiecutter.package_name }}.train --config configs/default.yaml            # 1 process
    torchrun --standalone --nproc_per_node=8 -m {{ cookiecutter.package_name }}.train \\
        --config configs/default.yaml train.lr=3e-4                          # 8 GPUs, one node
    torchrun --nnodes=2 --node_rank=$NODE_RANK --nproc_per_node=8 \\
        --master_addr=$MASTER_ADDR --master_port=29622 \\
        -m {{ cookiecutter.package_name }}.train --config configs/default.yaml          # 2 nodes
Or use scripts/train.sh, scripts/train_multinode.sh and scripts/train.sbatch.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from . import checkpoint, config, data, dist, optim
from .checkpoint import TrainState
from .config import Config, ConfigError
from .dist import DistInfo
from .metrics import Totals, TrainingLog, real_sample_mask
from .model import build_model

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/default.yaml", help="YAML file with the run's settings")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.lr=3e-4 data.batch_size=64")
    return parser.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    info = DistInfo.from_env()
    try:
        # before any collective: every rank finds the same problem and exits alone
        cfg = config.load(args.config, args.overrides)
        check_hardware(cfg, info)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr, flush=True)
        return 2
    dist.init(info, cfg.dist.timeout_minutes)
    try:
        code = run(cfg, info)
    except BaseException as err:
        dist.report_failure(info, err)
        raise
    dist.teardown(info)
    return code


def check_hardware(cfg: Config, info: DistInfo) -> None:
    if cfg.train.precision == "bf16" and info.device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("train.precision: bf16 is not supported by this GPU; use train.precision=fp16")


@dataclass
class Job:
    """Everything `build` makes for a run; `fit` trains it."""

    model: nn.Module  # what the loop calls: DDP(compiled(module)) when distributed
    eval_model: nn.Module  # the same weights without DDP
    state: TrainState
    train_loader: DataLoader
    eval_loader: DataLoader
    global_batch: int
    lr: float
    warmup: float
    workers: int
    total_steps: int


def run(cfg: Config, info: DistInfo) -> int:
    """Build, resume, train and save; returns the process exit code."""
    job = build(cfg, info)
    resumed = checkpoint.resume(job.state, cfg.run_dir, cfg.checkpoint.resume, info)
    if info.is_main:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        config.save(cfg, cfg.run_dir / "config.yaml")
    report_startup(cfg, info, job, resumed)
    outcome = fit(job, cfg, info, checkpoint.PreemptionFlag())
    checkpoint.save(job.state, cfg.run_dir, config.to_dict(cfg), info, cfg.checkpoint.keep_last)
    if outcome == "preempted":
        dist.print0(info, f"preempted at step {job.state.step}: checkpoint written; rerun to continue")
        return checkpoint.PREEMPTED_EXIT_CODE
    dist.print0(info, f"done: {job.state.step} steps; outputs in {cfg.run_dir}")
    return 0


def build(cfg: Config, info: DistInfo) -> Job:
    cpus = dist.cpus_available()
    torch.set_num_threads(data.threads_per_rank(cpus, info.local_world_size))
    torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
    dist.seed_everything(cfg.run.seed)  # after init, before the model exists (P5)
    raw_model = build_model(cfg)
    model, eval_model = wrap(raw_model, cfg, info)

    workers = data.workers_per_rank(cpus, info.local_world_size, cfg.data.max_workers)
    workers = workers if cfg.data.num_workers == "auto" else cfg.data.num_workers
    train_loader, eval_loader = data.build_loaders(cfg, info, workers)
    data.check_equal_lengths(len(train_loader), info)

    global_batch = cfg.data.batch_size * info.world_size * cfg.train.grad_accum_steps
    steps_per_epoch = len(train_loader) // cfg.train.grad_accum_steps
    total_steps = min(cfg.train.epochs * steps_per_epoch, cfg.train.max_steps or float("inf"))
    lr = optim.scaled_lr(cfg.train.lr, global_batch, cfg.train.reference_batch_size, cfg.train.lr_scaling)
    warmup = optim.warmup_fraction(cfg.train.warmup_fraction, global_batch, cfg.train.reference_batch_size)
    optimizer = optim.build_optimizer(raw_model, lr, cfg.train.weight_decay)
    state = TrainState(
        model=raw_model,
        optimizer=optimizer,
        scheduler=optim.build_scheduler(optimizer, cfg.train, total_steps, warmup),
        scaler=torch.amp.GradScaler(info.device.type, enabled=cfg.train.precision == "fp16"),
    )
    return Job(model, eval_model, state, train_loader, eval_loader, global_batch, lr, warmup, workers, total_steps)


def fit(job: Job, cfg: Config, info: DistInfo, preemption) -> str:
    """Epochs of training and evaluation until total_steps or a preemption ("preempted")."""
    state, sampler = job.state, job.train_loader.sampler
    log = TrainingLog(info, cfg.run_dir / "metrics.jsonl", job.total_steps)
    outcome = None
    while state.step < job.total_steps and outcome != "preempted":
        sampler.set_epoch(state.epoch)  # a new order every epoch (P7)
        sampler.skip = state.batch_in_epoch * cfg.data.batch_size  # resume mid-epoch
        outcome = train_one_epoch(state, job.model, job.train_loader, cfg, info, log, preemption, job.total_steps)
        if outcome != "preempted":
            log.write(
                {"step": state.step, "epoch": state.epoch, **evaluate(job.eval_model, job.eval_loader, cfg, info)}
            )
        if outcome == "epoch_end":
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0
    log.close()
    return outcome


def wrap(model: nn.Module, cfg: Config, info: DistInfo) -> tuple[nn.Module, nn.Module]:
    """SyncBN -> device -> compile -> DDP, in that order (P11). Returns (train, eval) modules.

    The eval module is the same weights without the DDP wrapper, so evaluation runs no
    collectives and ranks may hold different numbers of eval batches.
    """
    if cfg.train.sync_batchnorm and info.device.type == "cuda" and info.distributed:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # before DDP, or DDP syncs stale modules
    elif cfg.train.sync_batchnorm:
        why = "a world of one has nothing to sync" if not info.distributed else "SyncBatchNorm needs CUDA"
        dist.print0(info, f"note: train.sync_batchnorm is on but unused: {why}; BatchNorm stays per-rank")
    model.to(info.device)
    if cfg.train.compile:
        model = torch.compile(model)
    eval_model = model
    if info.distributed:
        model = DDP(
            model,
            device_ids=[info.local_rank] if info.device.type == "cuda" else None,
            bucket_cap_mb=cfg.dist.bucket_cap_mb,
            find_unused_parameters=cfg.dist.find_unused_parameters,  # off: costs 10-20% a step (P13)
            gradient_as_bucket_view=True,  # gradients live in the buckets: one copy fewer (P14)
            static_graph=cfg.dist.static_graph,
        )
    return model, eval_model


def train_one_epoch(
    state: TrainState,
    model: nn.Module,
    loader,
    cfg: Config,
    info: DistInfo,
    log: TrainingLog,
    preemption,
    total_steps: int,
) -> str:
    """Optimizer steps until the epoch ends ("epoch_end"), total_steps ("max_steps") or a
    preemption request reaches every rank ("preempted")."""
    accum = cfg.train.grad_accum_steps
    autocast = torch.autocast(
        info.device.type, dtype=AUTOCAST_DTYPES[cfg.train.precision], enabled=cfg.train.precision != "fp32"
    )
    model.train()
    batches = iter(loader)
    for micro_step in range(len(loader) - len(loader) % accum):  # drop a partial accumulation
        wait_start = time.perf_counter()
        inputs, targets = next(batches)
        data_wait = time.perf_counter() - wait_start
        inputs = inputs.to(info.device, non_blocking=True)  # async with pinned memory (P18)
        targets = targets.to(info.device, non_blocking=True)
        syncs = (micro_step + 1) % accum == 0
        # only the last micro-batch all-reduces; the others accumulate locally (P16)
        with nullcontext() if syncs or not info.distributed else model.no_sync():
            with autocast:
                loss = F.cross_entropy(model(inputs), targets)
            state.scaler.scale(loss / accum).backward()
        log.record(loss, len(targets), data_wait)
        state.batch_in_epoch += 1
        if not syncs:
            continue
        optimizer_step(state, cfg)
        state.step += 1
        done = state.step >= total_steps
        if state.step % cfg.run.log_every == 0 or done:
            record = log.flush(state.step, state.epoch, state.scheduler.get_last_lr()[0], preemption.requested)
            check_finite(record["loss"], state.step, cfg)
            if record["stop"]:
                return "preempted"
        if done:
            return "max_steps"
        if state.step % cfg.checkpoint.every_steps == 0:
            checkpoint.save(state, cfg.run_dir, config.to_dict(cfg), info, cfg.checkpoint.keep_last)
    return "epoch_end"


def optimizer_step(state: TrainState, cfg: Config) -> None:
    if cfg.train.grad_clip is not None:
        state.scaler.unscale_(state.optimizer)  # clip the true gradients, not the scaled ones
        nn.utils.clip_grad_norm_(state.model.parameters(), cfg.train.grad_clip)
    state.scaler.step(state.optimizer)  # fp16: skipped if the gradients overflowed
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=True)  # frees the memory instead of writing zeros (P17)
    state.scheduler.step()


def check_finite(loss: float, step: int, cfg: Config) -> None:
    """Stop every rank on a NaN/inf loss (the value was reduced, so all ranks agree)."""
    if not math.isfinite(loss):
        raise FloatingPointError(
            f"loss is {loss} at step {step}: lower train.lr (now {cfg.train.lr}) or lengthen the "
            f"warmup (train.warmup_fraction, now {cfg.train.warmup_fraction}); with fp16 try bf16"
        )


@torch.no_grad()
def evaluate(model: nn.Module, loader, cfg: Config, info: DistInfo) -> dict:
    """Loss and accuracy over every eval sample exactly once, whatever the world size (P26)."""
    model.eval()
    totals = Totals(("loss", "correct", "count"), info.device)
    position = 0
    for inputs, targets in loader:
        inputs = inputs.to(info.device, non_blocking=True)
        targets = targets.to(info.device, non_blocking=True)
        with torch.autocast(
            info.device.type, dtype=AUTOCAST_DTYPES[cfg.train.precision], enabled=cfg.train.precision != "fp32"
        ):
            logits = model(inputs).float()
        real = real_sample_mask(position, len(targets), info, len(loader.dataset), info.device)
        position += len(targets)
        losses = F.cross_entropy(logits, targets, reduction="none")
        totals.add(loss=losses[real].sum(), correct=(logits.argmax(1) == targets)[real].sum(), count=real.sum())
    sums = totals.reduced()
    model.train()
    return {
        "eval_loss": sums["loss"] / sums["count"],
        "eval_accuracy": sums["correct"] / sums["count"],
        "eval_samples": int(sums["count"]),
    }


def report_startup(cfg: Config, info: DistInfo, job: Job, resumed) -> None:
    params = sum(p.numel() for p in job.state.model.parameters())
    # params + grads + AdamW's two moments, in fp32; AMP adds low-precision weight copies,
    # budgeted at 4 bytes per parameter. DDP replicates all of it on every device (P28).
    per_param = 4 + 4 + 8 + (4 if cfg.train.precision != "fp32" else 0)
    dist.print0(
        info,
        f"world size {info.world_size} ({info.local_world_size} per node), backend {info.backend}, "
        f"device {info.device}\n"
        f"global batch {job.global_batch} = {cfg.data.batch_size} per device x {info.world_size} ranks x "
        f"{cfg.train.grad_accum_steps} accumulation steps\n"
        f"lr {job.lr:.3g} ({cfg.train.lr_scaling} scaling of {cfg.train.lr:g} tuned at batch "
        f"{cfg.train.reference_batch_size}), warmup {job.warmup:.1%} of {job.total_steps} steps\n"
        f"precision {cfg.train.precision}, compile {cfg.train.compile}, loader workers per rank {job.workers}\n"
        f"parameters {params:,}; static memory per device ~{params * per_param / 2**20:.1f} MiB\n"
        + (f"resumed from {resumed} at step {job.state.step}" if resumed else "starting fresh"),
    )


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
