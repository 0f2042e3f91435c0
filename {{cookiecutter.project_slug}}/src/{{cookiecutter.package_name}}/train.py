"""Train with DistributedDataParallel, or with the model sharded over the ranks (parallel.strategy=fsdp).

    python -m {{ cookiecutter.package_name }}.train --config configs/default.yaml            # 1 process
    torchrun --standalone --nproc_per_node=8 -m {{ cookiecutter.package_name }}.train \\
        --config configs/default.yaml optim.lr=3e-4                          # 8 GPUs, one node
    torchrun --nnodes=2 --node_rank=$NODE_RANK --nproc_per_node=8 \\
        --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT \\
        -m {{ cookiecutter.package_name }}.train --config configs/default.yaml          # 2 nodes
Or use scripts/train.sh, scripts/train_multinode.sh and scripts/train.sbatch.

The file reads in call order: main -> run -> build (and wrap) -> fit -> train_one_epoch ->
train_step -> evaluation (loop/evaluation.py). What a run carries lives in loop/state.py (Job,
TrainState), its start-up report in loop/startup.py; the callbacks (run.callbacks) and the moments
they run at in loop/callbacks.py.
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import config, task
from .base import cpus, dist, hardware, preemption, records
from .base.batching import unwrap
from .base.dist import DistInfo
from .base.rules import ConfigError, exit_on_user_error
from .config import Config
from .loop import checkpoint, elastic, loaders, optim, parallel, sharded_checkpoint, startup, tensorboard, tracking
from .loop.callbacks import Callbacks, Run
from .loop.evaluation import evaluate
from .loop.metrics import TrainingLog, Window
from .loop.preflight import check_declared_terms, check_task
from .loop.profiling import StepClock, profile_window
from .loop.state import Job, TrainState


class Outcome(enum.Enum):
    EPOCH_END = "the epoch ran out"
    MAX_STEPS = "train.max_steps or the planned steps are done"
    PREEMPTED = "a preemption request reached every rank"
    STOPPED = "a callback stopped the run (early stopping)"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config.add_config_option(parser)
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. optim.lr=3e-4 data.batch_size=64")
    return parser.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    info = DistInfo.from_env()
    with exit_on_user_error():  # before any collective: every rank finds the same problem
        cfg, sources = config.compose(config.files(args.config), args.overrides)
        dist.bind_device(info)  # first: a CUDA query from an unbound rank opens a context on GPU 0
        check_settings(cfg, info.device, sources)
    info = parallel.with_backend(cfg, info)
    trackers = tracking.Trackers()  # W&B / MLflow on rank 0, as run.trackers says
    for line in (sources.describe(), sources.renamed_note()):
        if line:
            dist.print0(info, line)
    code = dist.run_in_group(info, cfg.dist.timeout_minutes, lambda: run(cfg, info, trackers, sources))
    if not trackers.wait():  # out of the process group: no rank waits at a barrier for rank 0's trackers
        # a tracker call still hangs, and its library's exit handlers would wait for it: leave without them
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def check_settings(cfg: Config, device: torch.device, sources: config.Sources | None = None) -> None:
    """The settings against each other, this torch and this kind of device: a ConfigError, before any
    collective, saying where the setting it names was given (`sources`: what `cfg` was built from).
    Every rank checks on its own device; the node launcher once, before the workers start."""
    try:
        problem = hardware.precision_problem(cfg.train.precision, device)
        if problem:
            raise ConfigError(problem)
        optim.check(cfg)
        parallel.check(cfg, device)
        checkpoint.check(config.to_dict(cfg))
        tensorboard.check(cfg.run.tensorboard)
        tracking.check(cfg.run.trackers)
        Callbacks.from_config(cfg)  # each name resolves, and its section makes sense
    except ConfigError as err:
        raise (sources.located(err) if sources else err) from None


def run(
    cfg: Config, info: DistInfo, trackers: tracking.Trackers | None = None, sources: config.Sources | None = None
) -> int:
    """Build, resume, train and save; returns the process exit code. `trackers` (empty, from
    `main`) are started here and told the run's end; the caller waits for them. `sources`: what
    `cfg` was built from, recorded in the run's config.yaml."""
    try:
        with parallel.unreduced_parameters_named():
            return train_and_save(cfg, info, trackers, sources)
    finally:  # however the run ends, a checkpoint write in flight ends before the process group
        sharded_checkpoint.WRITES.close(cfg.dist.timeout_minutes)


def train_and_save(cfg: Config, info: DistInfo, trackers: tracking.Trackers | None, sources) -> int:
    problem = dist.shared_dir_problem(info, cfg.run_dir.root)  # every rank loads the checkpoint it resumes from
    if problem:
        raise ConfigError(problem)
    resumed, saved = checkpoint.choose(cfg.run_dir, cfg.checkpoint.resume, info)
    batch_line, asked = None, config.to_dict(cfg)
    if saved is not None:  # before build: another world size keeps the global batch with another split
        cfg, batch_line = elastic.keep_global_batch(cfg, saved, info.world_size)
    job = build(cfg, info, asked)
    if resumed:
        peak_lr = job.state.optimizer.param_groups[0]["initial_lr"]  # optim.lr scaled to this run's global batch
        checkpoint.restore(job.model, job.state, resumed, saved, info, config.to_dict(cfg), asked)
        elastic.rescale_lr(job.state, peak_lr)
        del saved  # the whole state of a big model: not kept for the run's length
    if batch_line:
        dist.print0(info, batch_line)
    if resumed and job.state.step >= job.total_steps:  # its files stay as the finished run left them
        dist.print0(info, startup.nothing_to_train(cfg, job.state.step, job.total_steps))
        return 0
    if info.is_main:
        cfg.run_dir.root.mkdir(parents=True, exist_ok=True)
        config.save(cfg, cfg.run_dir.config, sources)
        checkpoint.set_aside_later(cfg.run_dir, job.state.step)
    for callback in job.state.callbacks:
        callback.on_start(job.run)
    if job.run.stop_reason:  # a requeue of a run a callback stopped: it stays stopped
        dist.print0(info, f"this run stopped at step {job.state.step} ({job.run.stop_reason}); nothing to train")
        return 0
    if trackers is not None:
        job.state.tracked_run_id = trackers.start(cfg, info, resumed, job.state)
    with training_log(job, cfg, info, trackers) as log:
        startup.report(cfg, info, job, log, resumed)
        outcome = fit(job, cfg, info, log, preemption.PreemptionFlag())
        final = save_checkpoint(job, cfg, info, final=True)  # written when this returns, async_save or not
        for callback in job.state.callbacks:
            callback.on_end(job.run, outcome.value)
        if outcome is Outcome.PREEMPTED:  # leaving the log finishes the trackers after the checkpoint
            dist.print0(info, f"preempted at step {job.state.step}: checkpoint written; rerun to continue")
            return preemption.report_preemption()
        summary = log.summary(job.state.step, task.MAIN_METRIC, cfg.run_dir, final, job.run.stop_reason)
        dist.print0(info, summary)
    return 0


def build(cfg: Config, info: DistInfo, asked: dict | None = None) -> Job:
    """The run's model, data, optimizer and callbacks, set up; `asked`: the settings as given, where
    a resume on another world size split the global batch anew (`cfg` is what runs)."""
    torch.set_num_threads(cpus.threads_per_rank(os.environ, info.local_world_size))  # a user's OMP_NUM_THREADS wins
    torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
    dist.seed_everything(cfg.run.seed)  # after init, before the model exists
    # local rank 0 first: a download in the seam (weights, a dataset) happens once a node
    raw_model, (train_set, eval_set) = dist.local_main_first(
        info, lambda: (task.build_model(cfg), loaders.datasets(cfg))
    )
    workers = loaders.resolve_workers(cfg.data, cpus.cpus_available(), info.local_world_size)
    train_loader, eval_loader = loaders.build_loaders(train_set, eval_set, cfg, info, workers)
    reference_loader = loaders.reference_loader(train_set, cfg, info, workers)  # task.reference_set, if any
    # on the CPU, before any transfer
    check_task(raw_model, (train_set, train_loader), (eval_set, eval_loader), reference_loader)
    # the seam names units in the model as built: fully_shard changes their classes (FSDPBlock)
    units = parallel.units(raw_model) if cfg.parallel.strategy == "fsdp" else []
    model = wrap(raw_model, cfg, info)
    loaders.check_equal_lengths(len(train_loader), info)

    global_batch = cfg.data.batch_size * info.world_size * cfg.train.grad_accum_steps
    steps_per_epoch = len(train_loader) // cfg.train.grad_accum_steps
    total_steps = min(cfg.train.epochs * steps_per_epoch, cfg.train.max_steps or float("inf"))
    rule = optim.scaling_rule(cfg.optim.lr_scaling, cfg.optim.name)
    lr = optim.scaled_lr(cfg.optim.lr, global_batch, cfg.optim.reference_batch_size, rule)
    warmup = optim.warmup_fraction(cfg.schedule.warmup_fraction, global_batch, cfg.optim.reference_batch_size)
    optimizer = optim.build_optimizer(raw_model, cfg, lr)
    state = TrainState(
        optimizer=optimizer,
        scheduler=optim.build_scheduler(optimizer, cfg, total_steps, warmup),
        scaler=torch.amp.GradScaler(info.device.type, enabled=cfg.train.precision == "fp16"),
        callbacks=Callbacks.from_config(cfg),
    )
    job = Job(
        model=model,
        state=state,
        run=Run(model, state, info, cfg.run_dir, total_steps),
        train_loader=train_loader,
        eval_loader=eval_loader,
        reference_loader=reference_loader,
        total_steps=total_steps,
        global_batch=global_batch,
        clock=StepClock(info.device),
        profiler=profile_window(cfg.run.profile_steps, cfg.run.profile_ranks, cfg.run_dir, info),
        units=units,
        asked=asked,
    )
    for callback in state.callbacks:  # before a resume loads their state into what they made
        callback.setup(job.run)
    return job


def wrap(model: nn.Module, cfg: Config, info: DistInfo) -> nn.Module:
    """SyncBN -> device -> activation checkpointing -> compile -> DDP or FSDP, in that order."""
    if cfg.parallel.sync_batchnorm and info.device.type == "cuda" and info.distributed:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # before DDP, or DDP syncs stale modules
    elif cfg.parallel.sync_batchnorm and has_batchnorm(model):
        why = "a world of one has nothing to sync" if not info.distributed else "SyncBatchNorm needs CUDA"
        dist.print0(info, f"note: parallel.sync_batchnorm is on but unused: {why}; BatchNorm stays per-rank")
    model.to(info.device)
    sharded = cfg.parallel.strategy == "fsdp" and info.distributed
    units = parallel.units(model) if sharded or cfg.parallel.activation_checkpointing != "none" else []
    left_out = parallel.checkpoint_activations(units, cfg.parallel.activation_checkpointing)
    if left_out:
        dist.print0(info, f"note: {len(left_out)} units hold BatchNorm and keep their activations (no recompute)")
    if cfg.train.compile:
        note = syncbn_compile_note(model, cfg.train.compile)
        if note:
            dist.print0(info, note)
        if sharded:  # per unit, as FSDP gathers them: the shards stay the compiled graphs' inputs
            for unit in units:
                unit.compile()
        else:
            model = torch.compile(model)
    if sharded:
        model = parallel.shard(model, units, cfg.parallel, cfg.train.precision)
    elif info.distributed:
        model = DDP(
            model,
            device_ids=[info.local_rank] if info.device.type == "cuda" else None,
            bucket_cap_mb=cfg.parallel.bucket_cap_mb,
            find_unused_parameters=cfg.parallel.find_unused_parameters,  # off: costs 10-20% a step
            gradient_as_bucket_view=True,  # gradients live in the buckets: one copy fewer
            static_graph=cfg.parallel.static_graph,
        )
    return model


def has_batchnorm(model: nn.Module, sync: bool = False) -> bool:
    """Whether `model` has a BatchNorm layer of any kind (SyncBatchNorm included), or with
    `sync` a SyncBatchNorm layer."""
    kind = nn.SyncBatchNorm if sync else nn.modules.batchnorm._BatchNorm
    return any(isinstance(module, kind) for module in model.modules())


def syncbn_compile_note(model: torch.nn.Module, compile_model: bool) -> str | None:
    """torch.compile breaks its graph at every SyncBatchNorm layer (pytorch#161302): together they
    keep SyncBN's cost and lose most of compile's gain. Say so rather than run slow in silence."""
    if not compile_model or not has_batchnorm(model, sync=True):
        return None
    return (
        "note: train.compile with SyncBatchNorm: torch.compile breaks its graph at every SyncBatchNorm "
        "layer (pytorch#161302) and gains little; keep SyncBN for small per-device batches (< 8), "
        "else set parallel.sync_batchnorm=false to get compile's speed"
    )


def training_log(job: Job, cfg: Config, info: DistInfo, trackers: tracking.Trackers | None = None) -> TrainingLog:
    """metrics.jsonl and the console, with the task's throughput and MFU where a peak is known;
    TensorBoard (run.tensorboard) and started `trackers` (run.trackers)."""
    return TrainingLog(
        info,
        cfg.run_dir.metrics,
        job.total_steps,
        job.state.step,
        board=tensorboard.open_board(cfg.run.tensorboard, cfg.run_dir, job.state.step, info),
        trackers=trackers,
        throughput=task.throughput(cfg, unwrap(job.model)),
        peak=hardware.peak_flops(info.device, cfg.train.precision, cfg.run.peak_tflops),
    )


def fit(job: Job, cfg: Config, info: DistInfo, log: TrainingLog, stop: preemption.PreemptionFlag) -> Outcome:
    """Epochs of training until total_steps or a preemption, evaluating as eval.every says."""
    state = job.state
    if cfg.eval.at_start and state.step == 0:
        run_evaluation(job, cfg, info, log)  # the baseline: the untrained model
    outcome = None
    try:
        while state.step < job.total_steps and outcome not in (Outcome.PREEMPTED, Outcome.STOPPED):
            job.train_loader.sampler.set_epoch(state.epoch)  # a new order every epoch
            if hasattr(job.train_loader.dataset, "set_epoch"):  # e.g. augmentation seeded per sample and epoch
                job.train_loader.dataset.set_epoch(state.epoch)
            # resume mid-epoch: after what the epoch read, on earlier world sizes too
            job.train_loader.sampler.resume_at(state.earlier_layouts, state.batch_in_epoch * cfg.data.batch_size)
            outcome = train_one_epoch(job, cfg, info, log, stop)
            if outcome is Outcome.MAX_STEPS or (outcome is Outcome.EPOCH_END and cfg.eval.every is None):
                run_evaluation(job, cfg, info, log)
                outcome = Outcome.STOPPED if job.run.stop_reason else outcome
            if outcome is Outcome.EPOCH_END:
                state.epoch, state.batch_in_epoch, state.earlier_layouts = state.epoch + 1, 0, []
    finally:
        if job.profiler is not None:
            job.profiler.close()  # writes the trace of a window the run ended inside
    return outcome


def train_one_epoch(job: Job, cfg: Config, info: DistInfo, log: TrainingLog, stop) -> Outcome:
    """Optimizer steps until the epoch ends, total_steps, or a stop request reaches every rank.

    At every log step (every checkpoint step is one too) the ranks agree on one reduced window
    (log.flush): a NaN/inf loss in it stops the run before anything is written from it, and a
    stop request (`stop`, a preemption.PreemptionFlag) ends the epoch.
    """
    state, accum, clock = job.state, cfg.train.grad_accum_steps, job.clock
    job.model.train()
    batches = iter(job.train_loader)
    for _ in range(len(job.train_loader) // accum):  # a partial accumulation is dropped
        with clock.data_wait:
            micro_batches = [next(batches) for _ in range(accum)]
        loss_sum, terms, grad_norm = train_step(job, micro_batches, cfg, info)
        log.record(loss_sum, terms, accum * cfg.data.batch_size, grad_norm)
        if job.profiler is not None:  # run.profile_steps; when off, this check is all it costs
            job.profiler.after_step(state.step)
        due = Due.after(state.step, cfg, job.total_steps)
        if due.log:
            lr = state.scheduler.get_last_lr()[0]
            window = log.flush(state.step, state.epoch, lr, clock.read(), stop.requested)
            check_finite(window, cfg)
            if window.stop_requested:
                return Outcome.PREEMPTED
        if due.last:
            return Outcome.MAX_STEPS
        if due.evaluate:
            run_evaluation(job, cfg, info, log)  # leaves the model in train mode
            if job.run.stop_reason:
                return Outcome.STOPPED
        if due.save:
            save_checkpoint(job, cfg, info)
    return Outcome.EPOCH_END


@dataclass(frozen=True)
class Due:
    """What the loop does after an optimizer step: the run's cadence, decided in one place."""

    log: bool  # end the log window: reduce it, write it, check its loss and the stop requests
    save: bool  # write a checkpoint; always at a log step, so a NaN loss stops the run before it
    evaluate: bool  # eval.every
    last: bool  # the planned steps are done: fit evaluates, run saves the final checkpoint

    @classmethod
    def after(cls, step: int, cfg: Config, total_steps: int) -> Due:
        last = step >= total_steps
        save = step % cfg.checkpoint.every_steps == 0 and not last
        evaluate = bool(cfg.eval.every) and step % cfg.eval.every == 0 and not last
        return cls(log=last or save or step % cfg.run.log_every == 0, save=save, evaluate=evaluate, last=last)


def train_step(job: Job, micro_batches: list, cfg: Config, info: DistInfo) -> tuple[torch.Tensor, float, torch.Tensor]:
    """One optimizer step on this rank's micro-batches; returns (their summed loss on the device,
    their loss terms, the gradient norm before clipping or None without train.grad_clip)."""
    model, state, clock = job.model, job.state, job.clock
    # DDP and FSDP average gradients over ranks, so each rank scales its summed loss by world size /
    # the step's loss terms over every rank: the gradient becomes that of one process on the union
    # of all the micro-batches, however the terms are spread over ranks
    local_terms = float(sum(task.count_terms(batch) for batch in micro_batches))
    full = len(micro_batches) * cfg.data.batch_size  # drop_last: the loader's micro-batches are full
    loss_scale = info.world_size / step_terms(local_terms, full, info, micro_batches)
    loss_sum = torch.zeros((), device=info.device)
    with clock.fwd_bwd:  # includes DDP's all-reduce that backward could not hide
        for index, batch in enumerate(micro_batches):
            syncs = index == len(micro_batches) - 1  # only the last micro-batch reduces the gradients
            with parallel.micro_batch(model, syncs, cfg.parallel, info):
                with hardware.autocast(cfg.train.precision, info.device):
                    micro_loss = task.loss_sum(model, task.to_device(batch, info.device))
                state.scaler.scale(micro_loss * loss_scale).backward()
            loss_sum += micro_loss.detach()
    with clock.optimizer:
        if cfg.train.grad_clip is not None:
            state.scaler.unscale_(state.optimizer)  # clip the true gradients, not the scaled ones
        grad_norm = parallel.clip_gradients(model, cfg.train.grad_clip)  # None without train.grad_clip
        state.scaler.step(state.optimizer)  # fp16: skipped if the gradients overflowed
        state.scaler.update()
        state.optimizer.zero_grad(set_to_none=True)  # frees the memory instead of writing zeros
        state.scheduler.step()
    state.step += 1
    state.batch_in_epoch += len(micro_batches)
    for callback in state.callbacks:  # after the step is counted: run.state.step is the one just done
        callback.after_step(job.run)
    return loss_sum, local_terms, grad_norm


def step_terms(local_terms: float, samples: int, info: DistInfo, micro_batches: list = ()) -> float | torch.Tensor:
    """Loss terms of this optimizer step summed over every rank; `samples`: this rank's in full
    micro-batches, `micro_batches` the step's (counted where they hold fewer).

    When each sample holds task.TERMS_PER_SAMPLE terms no collective is needed: every rank
    runs the same number of full batches (drop_last), so the sum is world size x local.
    Otherwise one scalar all-reduce, its result left on the device (no host sync).
    """
    if task.TERMS_PER_SAMPLE is None:
        return all_reduced_terms(local_terms, info)
    check_declared_terms(local_terms, samples, micro_batches)
    return local_terms * info.world_size


def all_reduced_terms(local_terms: float, info: DistInfo) -> torch.Tensor:
    terms = torch.tensor(local_terms, dtype=torch.float32)
    if info.device.type == "cuda":
        terms = terms.pin_memory()  # a pageable copy would wait for the queued kernels
    return dist.all_reduce_sum(terms.to(info.device, non_blocking=True))


def check_finite(window: Window, cfg: Config) -> None:
    """Stop every rank on a NaN/inf loss (the window was reduced, so all ranks agree), before a
    checkpoint can be written from the state it left."""
    if not window.losses_finite:
        step = window.record["step"]
        where = f"at step {step}" if window.first_step == step else f"between steps {window.first_step} and {step}"
        raise FloatingPointError(
            f"loss is nan or inf {where}: lower optim.lr (now {cfg.optim.lr}) or lengthen the "
            f"warmup (schedule.warmup_fraction, now {cfg.schedule.warmup_fraction}); with fp16 try bf16; "
            f"the last checkpoint was written before it"
        )


def save_checkpoint(job: Job, cfg: Config, info: DistInfo, final: bool = False) -> Path:
    """This step's checkpoint (every rank); `final`: on disk when this returns, async_save or not.
    One on disk of this step already (a callback asked for it) is not written again."""
    if job.saved is not None and job.saved[0] == job.state.step:
        return job.saved[1]
    settings, keep_last = config.to_dict(cfg), cfg.checkpoint.keep_last
    path = checkpoint.save(job.model, job.state, cfg.run_dir, settings, info, keep_last, final, job.asked)
    if final or not (checkpoint.format_of(settings) == "sharded" and cfg.checkpoint.async_save):
        job.saved = (job.state.step, path)
        for callback in job.state.callbacks:
            callback.after_checkpoint(job.run, path)
    return path


def run_evaluation(job: Job, cfg: Config, info: DistInfo, log: TrainingLog) -> None:
    """The model's evaluation, then each callback's models' under their prefix, in one record; the
    callbacks see its metrics, and a checkpoint one of them asked for is written."""
    results = evaluate(job.model, job.eval_loader, cfg, info, job.reference_loader)
    for prefix, model in job.state.callbacks.models_to_evaluate(job.run):
        results |= records.prefixed(evaluate(model, job.eval_loader, cfg, info, job.reference_loader), prefix)
    log.evaluation(job.state.step, job.state.epoch, results)
    if job.state.callbacks:
        job.saved = None  # their state moves: a checkpoint of this step written before is written anew
    for callback in job.state.callbacks:
        callback.after_evaluation(job.run, records.eval_metrics(results))
    if job.run.checkpoint_requested:
        job.run.checkpoint_requested = False
        save_checkpoint(job, cfg, info, final=True)


if __name__ == "__main__":
    sys.exit(main())
