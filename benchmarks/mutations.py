"""The mutation score of the generated project's tests: remove one DDP practice from the code,
with the smallest source change, and a test must fail.

    python benchmarks/mutations.py [--only NAME ...] [--list] [--check] [--keep DIR]

Bakes the default project (and, for the mutants that name other answers, a project with those:
parallel.strategy=fsdp for the FSDP settings, the image starter for its own data.py), checks that
each one's fast tier passes as baked, then for each mutant: copies its project, applies the
change (its text must occur exactly once), runs the fast tier (`python -m pytest`) and, where
nothing failed there, the slow tests named for the mutant. Prints a table (mutant, the practice,
the project, the tests that failed, seconds) and the score; exits 1 if a mutant survived. About
30 s a mutant on 2 CPU cores; not part of CI.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

from overhead import TEMPLATE

PACKAGE = Path("src") / "ddp_trainer"
FSDP = (("strategy", "fsdp"),)  # a project whose runs shard: the FSDP proofs are its own
IMAGE = (("task", "image_classification"),)


@dataclass(frozen=True)
class Mutant:
    name: str
    practice: str
    path: Path  # in the baked project
    old: str
    new: str
    slow: tuple[str, ...] = ()  # slow tests that catch it where the fast tier cannot
    answers: tuple[tuple[str, str], ...] = ()  # the project's answers besides the defaults

    def changed(self, text: str) -> str:
        if text.count(self.old) != 1:
            raise SystemExit(f"{self.name}: the text to change occurs {text.count(self.old)} times in {self.path}")
        changed = text.replace(self.old, self.new)
        try:  # a change that breaks the syntax (a line's indentation cut) would be "caught" by collection errors
            if self.path.suffix == ".py":
                compile(changed, str(self.path), "exec")
        except SyntaxError as err:
            raise SystemExit(f"{self.name}: the changed {self.path} does not compile ({err})") from None
        return changed

    def apply(self, project: Path) -> None:
        source = project / self.path
        source.write_text(self.changed(source.read_text()))


def in_package(module: str) -> Path:
    return PACKAGE / f"{module}.py"


TRAIN, LOADERS, OPTIM, CHECKPOINT, DIST, SHARDING, SAMPLERS, SHARDED_CHECKPOINT, ELASTIC, DATA = (
    in_package(m)
    for m in (
        "train",
        "loop/loaders",
        "loop/optim",
        "loop/checkpoint",
        "base/dist",
        "loop/parallel",
        "loop/samplers",
        "loop/sharded_checkpoint",
        "loop/elastic",
        "data",
    )
)
EVALUATION, PREFLIGHT, BATCHING, ACROSS_RANKS, METRICS, SMOKE, LAUNCH, CONFIG, TYPED_CONFIG, EXPORT, DIAGNOSE = (
    in_package(m)
    for m in (
        "loop/evaluation",
        "loop/preflight",
        "base/batching",
        "base/across_ranks",
        "loop/metrics",
        "tools/smoke",
        "tools/launch",
        "config",
        "base/typed_config",
        "tools/export",
        "tools/diagnose",
    )
)
PREPARE = in_package("tools/prepare")
SCHEDULES = in_package("base/schedules")
EMA, BEST, EARLY_STOPPING, SCALARS = (
    in_package(m) for m in ("loop/ema", "loop/best_checkpoints", "loop/early_stopping", "base/scalars")
)
CALLBACK_RESUME = (
    "tests/test_callbacks.py::"
    "test_2_ranks_with_every_built_in_killed_after_a_checkpoint_resume_bit_identical_and_on_1_rank[fsdp]"
)
LANGUAGE_MODEL = (("task", "language_model"),)
ELASTIC_PROOF = (
    "tests/test_elastic.py::"
    "test_a_run_killed_mid_epoch_goes_on_on_3_ranks_and_on_1_with_the_uninterrupted_runs_global_batches"
)
WRAP = "    model = wrap(raw_model, cfg, info)\n"
BUILD_UP_TO_THE_OPTIMIZER = (
    "    loaders.check_equal_lengths(len(train_loader), info)\n\n"
    "    global_batch = cfg.data.batch_size * info.world_size * cfg.train.grad_accum_steps\n"
    "    steps_per_epoch = len(train_loader) // cfg.train.grad_accum_steps\n"
    '    total_steps = min(cfg.train.epochs * steps_per_epoch, cfg.train.max_steps or float("inf"))\n'
    "    rule = optim.scaling_rule(cfg.optim.lr_scaling, cfg.optim.name)\n"
    "    lr = optim.scaled_lr(cfg.optim.lr, global_batch, cfg.optim.reference_batch_size, rule)\n"
    "    warmup = optim.warmup_fraction(cfg.schedule.warmup_fraction, global_batch, cfg.optim.reference_batch_size)\n"
    "    optimizer = optim.build_optimizer(raw_model, cfg, lr)\n"
)
MUTANTS = [
    Mutant(
        "no timeout at init",
        "P4 explicit timeout",
        DIST,
        "            timeout=timeout,\n            device_id=",
        "            device_id=",
    ),
    Mutant(
        "seed + rank",
        "P5 same seed on every rank",
        DIST,
        "    torch.manual_seed(seed)\n",
        "    torch.manual_seed(seed + int(os.environ.get('RANK', '0')))\n",
    ),
    Mutant(
        "no seed before the model",
        "P5 seeded after init, before the model",
        TRAIN,
        "    dist.seed_everything(cfg.run.seed)  # after init, before the model exists\n",
        "",
    ),
    Mutant(
        "sampler keeps the tail",
        "P6/P8 drop_last in the sampler",
        LOADERS,
        "ResumableSampler(train_set, shuffle=True, drop_last=True, **ranks)",
        "ResumableSampler(train_set, shuffle=True, drop_last=False, **ranks)",
    ),
    Mutant(
        "loader keeps the tail",
        "P8 drop_last in the loader",
        LOADERS,
        "batch_size=cfg.data.batch_size, drop_last=True, **shared",
        "batch_size=cfg.data.batch_size, drop_last=False, **shared",
    ),
    Mutant(
        "set_epoch not called",
        "P7 set_epoch every epoch",
        TRAIN,
        "            job.train_loader.sampler.set_epoch(state.epoch)  # a new order every epoch\n",
        "",
    ),
    Mutant(
        "equal-length check not called",
        "P10 equal loader lengths checked",
        TRAIN,
        "    loaders.check_equal_lengths(len(train_loader), info)\n",
        "",
    ),
    Mutant(
        "no_sync not used",
        "P16 accumulation with no_sync",
        SHARDING,
        "    return nullcontext() if syncs or not info.distributed else model.no_sync()",
        "    return nullcontext()",
    ),
    Mutant(
        "loss over local terms",
        "P16/P26 loss weighted by the global count",
        TRAIN,
        "loss_scale = info.world_size / step_terms(local_terms, full, info, micro_batches)",
        "loss_scale = 1 / local_terms",
    ),
    Mutant(
        "epoch counted in micro-batches",
        "P16 accumulation counts optimizer steps",
        TRAIN,
        "steps_per_epoch = len(train_loader) // cfg.train.grad_accum_steps",
        "steps_per_epoch = len(train_loader)",
    ),
    Mutant(
        "schedule counted in micro-batches",
        "P16/P23 the schedule counts optimizer steps",
        TRAIN,
        "optim.build_scheduler(optimizer, cfg, total_steps, warmup)",
        "optim.build_scheduler(optimizer, cfg, total_steps * cfg.train.grad_accum_steps, warmup)",
    ),
    Mutant(
        "clip not applied",
        "gradient clipping",
        SHARDING,
        "    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n",
        "    norm = torch.zeros(())\n",
    ),
    Mutant(
        "clip before unscale",
        "P15 fp16: unscale before clipping",
        TRAIN,
        "        state.scaler.unscale_(state.optimizer)  # clip the true gradients, not the scaled ones\n",
        "",
    ),
    Mutant(
        "LR rule off in scaled_lr",
        "P22 LR scaling",
        OPTIM,
        '    return {"linear": lr * ratio, "sqrt": lr * math.sqrt(ratio), "none": lr}[rule]',
        "    return lr",
    ),
    Mutant(
        "LR rule off at the call site",
        "P22 LR scaling",
        TRAIN,
        "lr = optim.scaled_lr(cfg.optim.lr, global_batch, cfg.optim.reference_batch_size, rule)",
        "lr = cfg.optim.lr",
    ),
    Mutant(
        "warmup off in build_scheduler",
        "P23 warmup",
        OPTIM,
        "    return 0 if warmup_share == 0 else max(1, round(total_steps * warmup_share))",
        "    return 1",
    ),
    Mutant(
        "warmup off at the call site",
        "P23 warmup",
        TRAIN,
        "optim.build_scheduler(optimizer, cfg, total_steps, warmup)",
        "optim.build_scheduler(optimizer, cfg, total_steps, 0.0)",
    ),
    Mutant(
        "auto scaling ignores the optimizer",
        "P22 LR scaling: linear for SGD, square root for the Adam family",
        TRAIN,
        "rule = optim.scaling_rule(cfg.optim.lr_scaling, cfg.optim.name)",
        'rule = optim.scaling_rule(cfg.optim.lr_scaling, "adamw")',
    ),
    Mutant(
        "optimizer setting dropped at the call site",
        "optim.name: the optimizer the settings name",
        TRAIN,
        "optimizer = optim.build_optimizer(raw_model, cfg, lr)",
        "optimizer = torch.optim.AdamW(optim.parameter_groups(raw_model, cfg.optim.weight_decay), lr=lr)",
    ),
    Mutant(
        "every schedule is cosine",
        "schedule.name: the schedule the settings name",
        OPTIM,
        "    return schedules.AFTER_WARMUP[schedule.name](step, total_steps, done, shape)",
        '    return schedules.AFTER_WARMUP["cosine"](step, total_steps, done, shape)',
    ),
    Mutant(
        "step schedule without its drops",
        "schedule.name=step: x gamma at each milestone",
        SCHEDULES,
        "    return shape.gamma**passed",
        "    return 1.0",
    ),
    Mutant(
        "the task's schedule ignored",
        "schedule.name=task: the seam's scheduler",
        OPTIM,
        '    if cfg.schedule.name == "task":\n        return task.build_scheduler(cfg, optimizer, total_steps)\n',
        "",
    ),
    Mutant(
        "checkpoint written in place",
        "P25 atomic checkpoints",
        CHECKPOINT,
        '    tmp = path.with_name(f".{path.name}.tmp")\n    with open(tmp, "wb") as f:',
        '    tmp = path\n    with open(tmp, "wb") as f:',
    ),
    Mutant(
        "pickle loading",
        "P25 weights_only loading",
        CHECKPOINT,
        'return torch.load(path, map_location="cpu", weights_only=True)',
        'return torch.load(path, map_location="cpu", weights_only=False)',
    ),
    Mutant(
        "RNG not restored",
        "exact resume: RNG state",
        CHECKPOINT,
        "        set_rng_state(saved[rank])\n",
        "        pass\n",
    ),
    Mutant(
        "loader draws from the global RNG",
        "exact resume: RNG state",
        LOADERS,
        "        generator=own_rng(seed, info.rank),\n",
        "",
    ),
    Mutant(
        "mid-epoch position not skipped",
        "exact resume: mid-epoch",
        TRAIN,
        "sampler.resume_at(state.earlier_layouts, state.batch_in_epoch * cfg.data.batch_size)",
        "sampler.resume_at(state.earlier_layouts, 0)",
    ),
    Mutant(
        "an earlier world size's reads not removed",
        "resume on another world size: the rest of the epoch once",
        SAMPLERS,
        "            order = self.unread(order, world, read)\n",
        "            pass\n",
    ),
    Mutant(
        "another world size's position taken as this one's",
        "resume on another world size: the rest of the epoch once",
        CHECKPOINT,
        '    state.continue_epoch_on(payload, info.world_size, config["data"]["batch_size"])\n',
        "",
        slow=(ELASTIC_PROOF,),
    ),
    Mutant(
        "sharded checkpoint written in place",
        "atomic sharded checkpoints",
        SHARDED_CHECKPOINT,
        "    partial = run_dir.partial_checkpoint(step)\n",
        "    partial = run_dir.checkpoint(step, sharded=True)\n",
    ),
    Mutant(
        "a sharded save keeps each rank's BatchNorm statistics",
        "sharded checkpoints hold rank 0's buffers",
        CHECKPOINT,
        "    dist.broadcast_buffers(model)\n    tensors = ",
        "    tensors = ",
        slow=(
            "tests/test_packs.py::test_a_run_on_shards_killed_mid_epoch_resumes_bit_identical_to_an_uninterrupted_one",
        ),
    ),
    Mutant(
        "an abandoned attempt's checkpoints left for auto-resume",
        "a run started before the newest checkpoint sets the later ones aside",
        TRAIN,
        "        checkpoint.set_aside_later(cfg.run_dir, job.state.step)\n",
        "",
    ),
    Mutant(
        "global batch not kept on another world size",
        "resume on another world size: the global batch kept",
        TRAIN,
        "        cfg, batch_line = elastic.keep_global_batch(cfg, saved, info.world_size)\n",
        "        batch_line = None\n",
        slow=(ELASTIC_PROOF,),
    ),
    Mutant(
        "NaN check removed",
        "non-finite loss stops the run",
        TRAIN,
        "            check_finite(window, cfg)\n",
        "",
        slow=("tests/test_train.py::test_non_finite_loss_stops_every_rank_with_advice",),
    ),
    Mutant(
        "Adam moments left out of the memory estimate",
        "P28 memory accounting",
        SHARDING,
        "            total += 4 * (2 * size + 1)",
        "            total += 4",
    ),
    Mutant(
        "eval padding counted",
        "P26 every eval sample once",
        EVALUATION,
        "            kept = 0 if repeat else 1",
        "            kept = 1",
    ),
    Mutant(
        "eval as a mean of per-rank means",
        "P26 exact global sums",
        EVALUATION,
        '        results, samples = task.metrics(reduced), int(reduced["samples"])',
        "        local = task.metrics(totals.local())\n"
        "        results = {name: dist.all_reduce_sum(torch.tensor(value, dtype=torch.float64)).item()"
        " / info.world_size for name, value in local.items()}\n"
        '        samples = int(reduced["samples"])',
    ),
    Mutant(
        "eval in train mode",
        "P26 evaluation in eval mode",
        EVALUATION,
        "    model.eval()\n    try:",
        "    try:",
    ),
    Mutant(
        "eval on this rank's BatchNorm statistics",
        "P26 evaluate the weights the checkpoint saves",
        EVALUATION,
        "    dist.broadcast_buffers(model)\n",
        "",
        slow=("tests/test_train.py::test_evaluate_gives_a_checkpoint_the_metrics_its_training_run_logged",),
    ),
    Mutant(
        "fsdp unit not sharded",
        "FSDP shards every unit",
        SHARDING,
        "        if unit not in norms:\n            fully_shard(unit, mp_policy=mixed, **options)",
        "        if unit not in norms and unit is not chosen[0]:\n"
        "            fully_shard(unit, mp_policy=mixed, **options)",
        answers=FSDP,
    ),
    Mutant(
        "fsdp tied weights split over units",
        "FSDP keeps tied weights in one group",
        SHARDING,
        "            if id(param) in inside and id(owner) not in members:",
        "            if False:",
        answers=FSDP,
    ),
    Mutant(
        "fsdp clip over the local shard only",
        "FSDP clips the whole gradient's norm",
        SHARDING,
        "    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)",
        # clip_grad_norm_'s own formula, over each rank's shard instead of the whole gradient
        "    grads = [p.grad.to_local() if hasattr(p.grad, 'to_local') else p.grad for p in model.parameters()]\n"
        "    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))\n"
        "    for g in grads:\n"
        "        g.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))",
        answers=FSDP,
    ),
    Mutant(
        "fsdp no gradient sync on the last micro-batch",
        "FSDP reduces the step's gradients",
        SHARDING,
        "        model.set_requires_gradient_sync(syncs or settings.reduce_every_micro_batch)",
        "        model.set_requires_gradient_sync(not syncs and settings.reduce_every_micro_batch)",
        answers=FSDP,
    ),
    Mutant(
        "fsdp optimizer built before sharding",
        "FSDP: the optimizer steps the shards",
        TRAIN,
        WRAP + BUILD_UP_TO_THE_OPTIMIZER,
        BUILD_UP_TO_THE_OPTIMIZER + WRAP,  # the optimizer holds the parameters fully_shard replaces
        answers=FSDP,
    ),
    Mutant(
        "parallel.reshard_after_forward ignored",
        "parallel.reshard_after_forward: what stays gathered after forward",
        SHARDING,
        '        "reshard_after_forward": settings.reshard_after_forward,',
        '        "reshard_after_forward": True,',
        answers=FSDP,
    ),
    Mutant(
        "parallel.reduce_every_micro_batch ignored",
        "parallel.reduce_every_micro_batch: sharded or whole gradients between micro-batches",
        SHARDING,
        "        model.set_requires_gradient_sync(syncs or settings.reduce_every_micro_batch)",
        "        model.set_requires_gradient_sync(True)",
        answers=FSDP,
    ),
    Mutant(
        "fsdp settings not checked before the run",
        "parallel.cpu_offload and fp16 refused before any collective",
        TRAIN,
        "        parallel.check(cfg, device)\n",
        "",
    ),
    Mutant(
        "cpu_offload without gloo beside nccl",
        "parallel.cpu_offload: the process group runs gloo for the CPU state",
        SHARDING,
        '    if cfg.parallel.strategy == "fsdp" and cfg.parallel.cpu_offload and info.backend == "nccl":',
        "    if False:",
    ),
    # the practices of the elastic restarts, async checkpoints, activation checkpointing and loader workers
    Mutant(
        "a split that ignores divisibility",
        "resume on another world size: the global batch exact whatever data.batch_size",
        ELASTIC,
        "        if per_rank % steps == 0 and per_rank // steps <= largest_batch:",
        "        if per_rank // steps <= largest_batch:",
    ),
    Mutant(
        "the lr not rescaled to a new global batch",
        "checkpoint.allow_new_global_batch: the peak lr by the scaling rule",
        TRAIN,
        "        elastic.rescale_lr(job.state, peak_lr)\n",
        "",
    ),
    Mutant(
        "epoch position counted in optimizer steps",
        "mid-epoch resume with accumulation: the position in micro-batches",
        TRAIN,
        "    state.batch_in_epoch += len(micro_batches)",
        "    state.batch_in_epoch += 1",
    ),
    Mutant(
        "no wait for the write in flight before a new save",
        "a failed background write never reported as success; one write in flight",
        CHECKPOINT,
        "    sharded_checkpoint.WRITES.wait()  # the previous one first: one write in flight, and its failure",
        "    pass  # the previous one first: one write in flight, and its failure",
    ),
    Mutant(
        "a failed background write published",
        "a failed background write is never published",
        SHARDED_CHECKPOINT,
        "                done.result()\n                finish()",
        "                finish()\n                done.result()",
    ),
    Mutant(
        "checkpoint.async_save ignored",
        "checkpoint.async_save: the write goes on behind the loop",
        CHECKPOINT,
        '    background, timeout = config["checkpoint"]["async_save"] and not final, config["dist"]["timeout_minutes"]',
        '    background, timeout = False, config["dist"]["timeout_minutes"]',
    ),
    Mutant(
        "checkpoint.format auto always full",
        "checkpoint.format=auto: sharded under fsdp",
        CHECKPOINT,
        '    if format_of(config) == "sharded":',
        '    if config["checkpoint"]["format"] == "sharded":',
    ),
    Mutant(
        "checkpoint settings not checked before the run",
        "checkpoint.async_save with full checkpoints refused before any collective",
        TRAIN,
        "        checkpoint.check(config.to_dict(cfg))\n",
        "",
    ),
    Mutant(
        "recompute draws new dropout masks",
        "activation checkpointing recomputes exactly, dropout included",
        SHARDING,
        "        chosen[index].forward = partial(checkpoint, chosen[index].forward, use_reentrant=False)",
        "        chosen[index].forward = partial(\n"
        "            checkpoint, chosen[index].forward, use_reentrant=False, preserve_rng_state=False\n"
        "        )",
    ),
    Mutant(
        "activation checkpointing ignored under ddp",
        "parallel.activation_checkpointing applies under ddp as under fsdp",
        TRAIN,
        '    units = parallel.units(model) if sharded or cfg.parallel.activation_checkpointing != "none" else []',
        "    units = parallel.units(model) if sharded else []",
    ),
    Mutant(
        "the dataset's epoch never set",
        "per-epoch augmentation reaches the loader workers",
        TRAIN,
        "                job.train_loader.dataset.set_epoch(state.epoch)\n",
        "                pass\n",
    ),
    Mutant(
        "the starter's epoch not in shared memory",
        "per-epoch augmentation reaches persistent workers started by fork",
        BATCHING,
        "torch.zeros((), dtype=torch.int64).share_memory_()",
        "torch.zeros((), dtype=torch.int64)",
    ),
    Mutant(
        "a restart on the same world size drops the split",
        "an elastic restart keeps the global batch the split kept",
        ELASTIC,
        "    if saved_world == world_size and (batch, steps) != given_split(payload):",
        "    if saved_world == world_size:",
    ),
    Mutant(
        "the resume note compares the split that ran",
        "the resume note lists only the settings the user changed",
        CHECKPOINT,
        "    changes = changed_settings(settings_given(payload), config if asked is None else asked)",
        '    changes = changed_settings(payload["config"], config if asked is None else asked)',
    ),
    # the optimizer's and schedule's settings at their call sites
    Mutant(
        "schedule.min_lr_ratio ignored",
        "schedule.min_lr_ratio: the floor the decay ends at",
        OPTIM,
        "    shape = schedules.Shape(schedule.min_lr_ratio, ",
        "    shape = schedules.Shape(0.1, ",
    ),
    Mutant(
        "schedule.milestones ignored",
        "schedule.milestones: where the step schedule drops",
        SCHEDULES,
        "    passed = sum(step >= round(total_steps * share) for share in shape.milestones)",
        "    passed = sum(step >= round(total_steps * share) for share in (0.5, 0.75))",
    ),
    Mutant(
        "optim.betas ignored",
        "optim.betas: AdamW's decay rates",
        OPTIM,
        '"betas": tuple(settings.betas),',
        '"betas": (0.9, 0.999),',
    ),
    Mutant(
        "optim.nesterov ignored",
        "optim.nesterov: SGD's Nesterov momentum",
        OPTIM,
        '"nesterov": settings.nesterov}',
        '"nesterov": False}',
    ),
    Mutant(
        "optim.momentum ignored",
        "optim.momentum: SGD's momentum",
        OPTIM,
        '"momentum": settings.momentum,',
        '"momentum": 0.9,',
    ),
    Mutant(
        "optim.weight_decay ignored",
        "optim.weight_decay: the decay of the matrices",
        OPTIM,
        "    groups, settings = parameter_groups(model, cfg.optim.weight_decay), cfg.optim",
        "    groups, settings = parameter_groups(model, 0.01), cfg.optim",
    ),
    Mutant(
        "data.prefetch_factor ignored",
        "P9 prefetch_factor when workers > 0",
        LOADERS,
        "        prefetch_factor=data.prefetch_factor if num_workers > 0 else None,",
        "        prefetch_factor=2 if num_workers > 0 else None,",
    ),
    # every task shape through the seam (issue 49)
    Mutant(
        "a task's collate ignored",
        "the seam: batches of any structure (task.collate)",
        LOADERS,
        '        collate_fn=getattr(task, "collate", default_collate),\n',
        "        collate_fn=default_collate,\n",
    ),
    Mutant(
        "evaluation batches dealt as DistributedSampler deals samples",
        "evaluation batches that do not depend on the world size",
        SAMPLERS,
        "        mine = batches[rank::world_size]\n",
        "        ours = list(range(rank, size, world_size))\n"
        "        mine = [ours[i : i + batch_size] for i in range(0, len(ours), batch_size)]\n",
        slow=("tests/test_seam.py::test_each_stand_ins_evaluation_is_the_same_on_one_two_and_three_ranks",),
    ),
    Mutant(
        "dataset outputs joined in rank order",
        "dataset-level metrics: each sample's output at its index",
        EVALUATION,
        "sorted((item for rank in gathered for item in rank), key=lambda item: item[0])",
        "(item for rank in gathered for item in rank)",
    ),
    Mutant(
        "a repeated batch's outputs kept",
        "dataset-level metrics: each sample once",
        EVALUATION,
        "            if not repeat:\n                outputs.append(",
        "            if True:\n                outputs.append(",
        slow=("tests/test_seam.py::test_each_stand_ins_evaluation_is_the_same_on_one_two_and_three_ranks",),
    ),
    Mutant(
        "dataset metrics not sent to every rank",
        "dataset-level metrics: computed once, on every rank",
        EVALUATION,
        "    computed = dist.broadcast_object(computed) if info.distributed else computed",
        "    computed = computed if info.is_main else {}",
        slow=("tests/test_seam.py::test_each_stand_ins_evaluation_is_the_same_on_one_two_and_three_ranks",),
    ),
    Mutant(
        "the gather's gradients not sent back to their ranks",
        "losses across ranks: the differentiable gather",
        ACROSS_RANKS,
        "        torch_dist.all_reduce(grad)\n",
        "",
        slow=(
            "tests/test_seam.py::"
            "test_the_proofs_and_the_smoke_check_hold_on_two_ranks_for_a_model_that_needs_a_state_and_one_of_keywords",
        ),
    ),
    Mutant(
        "an undeclared gather not stopped",
        "losses across ranks: LOSS_SPANS_RANKS checked at start-up",
        PREFLIGHT,
        "    _check_spans_ranks(bool(gathers))\n",
        "",
    ),
    Mutant(
        "the loss checked in eval mode at start-up",
        "modes: loss_sum in train mode",
        PREFLIGHT,
        '_check_loss(wrapped.train(), _batch("train", *train))',
        '_check_loss(wrapped.eval(), _batch("train", *train))',
    ),
    Mutant(
        "the start-up check leaves the statistics it changed",
        "the start-up check leaves no trace",
        PREFLIGHT,
        "                buffer.copy_(buffers[name])",
        "                pass",
    ),
    Mutant(
        "augmentation drawn without the epoch",
        "randomness in the data: drawn from (seed, epoch, index)",
        BATCHING,
        "hash((self.seed, int(self.epoch), index))",
        "hash((self.seed, 0, index))",
    ),
    Mutant(
        "a read leaves the process's generators moved",
        "randomness in the data: the process's own streams untouched",
        BATCHING,
        "            random.setstate(python)\n            np.random.set_state(numpy)\n",
        "            pass\n",
    ),
    # the first hour on the README's path (issue 50)
    Mutant(
        "the launcher checks composition only",
        "a config mistake is one line and exit 2 from every launcher",
        LAUNCH,
        '    train.check_settings(cfg, torch.device("cuda", 0) if visible_gpus() else torch.device("cpu"), sources)',
        "    pass",
    ),
    Mutant(
        "the batch script starts its nodes unchecked",
        "a config mistake is one line and exit 2 from every launcher",
        Path("scripts") / "train.sbatch",
        'python -m ddp_trainer.tools.launch check "${TRAIN[@]}"',
        "true",
        slow=("tests/test_sbatch.py",),
    ),
    Mutant(
        "a stop before torchrun starts unhandled",
        "a stop signal while the launcher starts ends it at once",
        LAUNCH,
        "        for sig in STOP_SIGNALS:  # before the slow imports: PID 1 of a container drops unhandled signals\n"
        "            signal.signal(sig, stop_before_start)\n        if",
        "        if",
        slow=("tests/test_launch.py",),
    ),
    Mutant(
        "a base applied again after the files given later",
        "config files compose: a base once, at its place",
        CONFIG,
        "            if layer_path.resolve() in applied:\n                continue\n",
        "",
    ),
    Mutant(
        "an error without the file it came from",
        "config errors name their file or override",
        CONFIG,
        '                raise typed_config.located(err, f"in {layer_path}", str(layer_path)) from None',
        "                raise",
    ),
    Mutant(
        "a base typed as a relative path read again",
        "config composition: a base that extends names is read once",
        CONFIG,
        "            applied.add(layer_path.resolve())",
        "            applied.add(layer_path)",
    ),
    Mutant(
        "every rank's loader workers seeded alike",
        "each rank's loader workers draw their own random numbers",
        LOADERS,
        "        generator=own_rng(seed, info.rank),",
        "        generator=own_rng(seed, 0),",
    ),
    Mutant(
        "a check's error without where its setting was given",
        "config errors name their file or override: settings that do not fit together too",
        TRAIN,
        "        raise (sources.located(err) if sources else err) from None",
        "        raise err from None",
    ),
    Mutant(
        "no closest key for a typo",
        "config errors: did you mean",
        TYPED_CONFIG,
        "    near = [k for k in known if k.startswith(key)][:1] or difflib.get_close_matches(key, known, 1)\n",
        "    near = [k for k in known if k.startswith(key)][:1]\n",
    ),
    Mutant(
        "two spellings of a setting on one command line",
        "config: one setting, one spelling on a command line",
        CONFIG,
        "        if earlier is not None and parse_override(earlier)[0] != key:",
        "        if False:",
    ),
    Mutant(
        "a missing extends target blamed on the file given",
        "config errors name the missing extends target",
        TYPED_CONFIG,
        "    if not target.is_file():  # the file given exists: it is the one to fix",
        "    if False:",
    ),
    Mutant(
        "an empty section wipes its settings",
        "config: a section named with nothing under it changes nothing",
        TYPED_CONFIG,
        "        if values is None:  # a section named with nothing under it changes nothing\n"
        "            tree.setdefault(name, {})\n        elif",
        "        if",
    ),
    Mutant(
        "a renamed key on the command line advised as in a file",
        "config: a renamed key on the command line named as such",
        CONFIG,
        "        typed = [item for item in where if item in self.overrides]",
        "        typed = []",
    ),
    Mutant(
        "the tests' run in the project's precision",
        "the tests run fp32 on a CPU whatever the answers",
        Path("configs") / "smoke.yaml",
        "  precision: fp32",
        "  precision: bf16",
    ),
    Mutant(
        "the progress bar moves only at log steps",
        "progress from the first step",
        METRICS,
        "        self.bar.update(1)\n",
        "",
    ),
    Mutant(
        "slow steps print nothing until a log step",
        "progress from the first step",
        METRICS,
        "        if first_estimate or quiet:",
        "        if first_estimate:",
    ),
    Mutant(
        "the smoke estimate counts one micro-batch a step",
        "the smoke check foresees its length",
        SMOKE,
        "seconds_per_pass * cfg.train.grad_accum_steps * steps",
        "seconds_per_pass * steps",
    ),
    Mutant(
        "the smoke check silent on a CPU about its plan",
        "the smoke check says at once what it runs on a CPU and names the quick check",
        SMOKE,
        '    if info.device.type == "cuda" or quick:',
        '    if info.device.type == "cuda":',
    ),
    Mutant(
        "the smoke check's gradient passes in fp32 whatever the run",
        "the smoke estimate times passes in the run's precision",
        SMOKE,
        "    with hardware.autocast(cfg.train.precision, info.device):\n        loss = task.loss_sum(model, batch)\n"
        "    loss.backward()\n    reduced",
        "    loss = task.loss_sum(model, batch)\n    loss.backward()\n    reduced",
    ),
    Mutant(
        "export --dtype ignored",
        "every export option honoured",
        EXPORT,
        "fmt = export_weights(args.checkpoint, args.output, args.format, args.dtype, args.weights)",
        "fmt = export_weights(args.checkpoint, args.output, args.format, None, args.weights)",
    ),
    Mutant(
        "diagnose traces loss_sum in the model's own mode",
        "modes: loss_sum in train mode (diagnose)",
        DIAGNOSE,
        "    model.train()  # the seam's contract: loss_sum sees train mode"
        " (a detector returns its losses only there)\n",
        "",
    ),
    Mutant(
        "diagnose memory's refusal blames the config",
        "a refusal says what it is",
        DIAGNOSE,
        '    prefix = "cannot estimate"',
        '    prefix = "config error"',
    ),
    Mutant(
        "diagnose memory adds the gradients into the weights",
        "diagnose memory: weights, gradients, optimizer state and activations apart",
        DIAGNOSE,
        "share + (4 * params if whole_gradients else 0), optimizer",
        "share, optimizer",
    ),
    Mutant(
        "prepare tokenizes the evaluation text into training too",
        "prepare --eval: the evaluation text out of the training tokens",
        PREPARE,
        "    tokens = token_ids(files, tokenizer).astype(dtype)",
        "    tokens = token_ids([*files, *(eval_files or [])], tokenizer).astype(dtype)",
        answers=LANGUAGE_MODEL,
    ),
    Mutant(
        "prepare records no special tokens",
        "the export's special-token ids are the data tokenizer's",
        PREPARE,
        '"special_tokens": special_tokens(tokenizer, vocabulary),',
        '"special_tokens": {},',
        answers=LANGUAGE_MODEL,
    ),
    # the features of issues 42-44 held on more than one rank (issue 51)
    Mutant(
        "the gradient norm logged as a sum over ranks",
        "the logged gradient norm is the global one",
        METRICS,
        '"grad_norm": total["grad_norm_sum"] / (self.norms * info.world_size)',
        '"grad_norm": total["grad_norm_sum"] / self.norms',
        slow=("tests/test_train.py::test_the_gradient_norm_logged_on_2_ranks_is_one_processs_on_the_global_batch",),
    ),
    Mutant(
        "the log window summed over ranks",
        "the logged step time is the ranks' mean",
        METRICS,
        'elapsed = total["windows"] / info.world_size',
        'elapsed = total["windows"]',
    ),
    Mutant(
        "the logged speed counts one micro-batch a step",
        "the logged samples count every micro-batch",
        TRAIN,
        "log.record(loss_sum, terms, accum * cfg.data.batch_size, grad_norm)",
        "log.record(loss_sum, terms, cfg.data.batch_size, grad_norm)",
    ),
    Mutant(
        "a sharded checkpoint of the previous layout read as it is",
        "previous-layout checkpoints of every format load with their renames",
        CHECKPOINT,
        '    if "config" in payload:  # written before',
        '    if "config" in payload and not payload.get("sharded"):  # written before',
    ),
    Mutant(
        "the settings as given not upgraded",
        "previous-layout checkpoints: the settings as given renamed too",
        CHECKPOINT,
        'payload["asked"] = upgrade(payload["asked"])[0]',
        'payload["asked"] = payload["asked"]',
    ),
    Mutant(
        "a checkpoint keeps rank 0's generators only",
        "each rank's generators resume exactly",
        CHECKPOINT,
        'payload = state.state_dict() | {"rng": rng_per_rank,',
        'payload = state.state_dict() | {"rng": rng_per_rank[:1],',
        slow=(
            "tests/test_resume.py::"
            "test_a_2_rank_run_whose_forward_draws_random_numbers_resumes_bit_identical_on_each_ranks_generators",
        ),
    ),
    Mutant(
        "new ranks seeded alike on a resume on more ranks",
        "a resume on more ranks: each new rank its own generators",
        CHECKPOINT,
        "dist.seed_everything(seed + rank)",
        "dist.seed_everything(seed)",
    ),
    Mutant(
        "callbacks' state left out of a full checkpoint",
        "a callback's state in every checkpoint",
        CHECKPOINT,
        '"callbacks": callback_state} | state.state_dict()',
        '"callbacks": {}} | state.state_dict()',
    ),
    Mutant(
        "callbacks' tensors left out of a sharded checkpoint",
        "a callback's sharded state stays sharded and comes back",
        CHECKPOINT,
        '        tensors["callbacks"] = callback_tensors\n',
        "        pass\n",
        slow=(CALLBACK_RESUME,),
    ),
    Mutant(
        "callbacks' state not loaded on a resume",
        "a callback's state comes back exactly on resume",
        CHECKPOINT,
        "    fresh = state.callbacks.load_state_dict(saved_callbacks)",
        "    fresh = []",
    ),
    Mutant(
        "after_step not called",
        "callbacks run after each optimizer step",
        TRAIN,
        "        callback.after_step(job.run)\n",
        "        pass\n",
    ),
    Mutant(
        "a callback's models not evaluated",
        "a callback's models evaluated under their prefix",
        TRAIN,
        "        results |= records.prefixed(",
        "        results = results or records.prefixed(",
    ),
    Mutant(
        "export --weights ema ignored",
        "EMA weights exported on request",
        EXPORT,
        '    if weights == "ema":\n        payload["model"] = checkpoint.ema_weights(path, payload)\n',
        "",
    ),
    Mutant(
        "a message names a helper that was renamed",
        "no user-facing text names a helper that does not exist",
        PREFLIGHT,
        "through batching.unwrap(model), e.g.",
        "through samples.unwrap(model), e.g.",
    ),
    Mutant(
        "a step's checkpoint kept after an evaluation moved the callbacks' state",
        "the final checkpoint holds the callbacks' state as the run ended",
        TRAIN,
        "        job.saved = None  # their state moves",
        "        pass  # their state moves",
    ),
    Mutant(
        "the launcher's refusal exits 1",
        "the launcher's own refusal is a usage error: exit 2",
        LAUNCH,
        '        print(f"launch error: {err}", file=sys.stderr, flush=True)\n        return 2',
        '        print(f"launch error: {err}", file=sys.stderr, flush=True)\n        return 1',
    ),
    Mutant(
        "did you mean: a loose match of another section",
        "an unknown key gets a near key of another section only when nearly the same",
        TYPED_CONFIG,
        "    near = difflib.get_close_matches(key, elsewhere, 1, ELSEWHERE_CUTOFF)",
        "    near = difflib.get_close_matches(key, elsewhere, 1)",
    ),
    Mutant(
        "a seeded dataset's own set_epoch not called",
        "a dataset wrapped for seeded draws still hears the epoch",
        BATCHING,
        '        if hasattr(self.dataset, "set_epoch"):\n            self.dataset.set_epoch(epoch)\n',
        "",
    ),
    Mutant(
        "seeded draws from seed + epoch",
        "augmentation drawn from (seed, epoch, index)",
        BATCHING,
        "hash((self.seed, int(self.epoch), index))",
        "hash((self.seed + int(self.epoch), index))",
    ),
    Mutant(
        "a base's setting blamed on the file that extends it",
        "a check's error names the file that gave the setting",
        CONFIG,
        '                (f"{section}.{key}", f"in {layer_path}") for section, keys in layer.items()',
        '                (f"{section}.{key}", f"in {path}") for section, keys in layer.items()',
    ),
    Mutant(
        "the proofs' batch ignores accumulation",
        "the proofs fit a step's micro-batches into a small training set",
        Path("tests/dist_proofs.py"),
        "    return min(cfg.data.batch_size, per_rank // accum)",
        "    return min(cfg.data.batch_size, per_rank)",
    ),
    Mutant(
        "did you mean: no prefix",
        "an unknown key that begins a known one gets that one",
        TYPED_CONFIG,
        "    near = [k for k in known if k.startswith(key)][:1] or difflib.get_close_matches(key, known, 1)",
        "    near = difflib.get_close_matches(key, known, 1)",
    ),
    Mutant(
        "did you mean: another section's same key after a loose one of its own",
        "a key under the wrong section gets that section's",
        TYPED_CONFIG,
        "    if key in elsewhere:\n",
        "    if False:\n",
    ),
    Mutant(
        "hang bounds as written whatever the model",
        "a test's time limit is a hang bound sized from the model's step time",
        Path("tests/conftest.py"),
        "    bound = seconds * slowdown * HANG_BOUND_SCALE\n",
        "    bound = seconds * HANG_BOUND_SCALE\n",
    ),
    Mutant(
        "the terms check assumes full micro-batches",
        "the terms check counts the samples the micro-batch holds",
        PREFLIGHT,
        "    if held and terms == task.TERMS_PER_SAMPLE * held:\n        return\n",
        "",
    ),
    Mutant(
        "ema lerp towards the old average",
        "EMA: decay x average + (1 - decay) x weights",
        EMA,
        "torch._foreach_lerp_(self.shadow, live, 1.0 - self.decay)",
        "torch._foreach_lerp_(self.shadow, live, self.decay)",
    ),
    Mutant(
        "ema start step ignored",
        "EMA starts at ema.start_step",
        EMA,
        "            if run.state.step <= self.start_step:",
        "            if False:",
    ),
    Mutant(
        "ema weights left in the model after its evaluation",
        "EMA's evaluation puts the model's weights back",
        EMA,
        "            copy_each(live, kept)",
        "            pass",
    ),
    Mutant(
        "best checkpoints ranked the wrong way",
        "the best k by the metric's direction",
        BEST,
        'reverse=self.goal == "max")',
        'reverse=self.goal == "min")',
    ),
    Mutant(
        "best checkpoints not linked",
        "the best k kept in checkpoints/best/",
        BEST,
        "            linked(path, best_dir(run) / path.name)\n            set_aside",
        "            set_aside",
    ),
    Mutant(
        "best entries of an abandoned timeline kept",
        "a resume sets aside best/ entries written after its checkpoint",
        BEST,
        "        set_aside_unranked(best_dir(run), {step for step, _ in self.ranked}, run)\n",
        "",
    ),
    Mutant(
        "early stopping forgets its decision on a requeue",
        "a stopped run stays stopped",
        EARLY_STOPPING,
        "        if self.reason:\n            run.stop(self.reason)",
        "        pass",
    ),
    Mutant(
        "early stopping without min_delta",
        "early stopping's min_delta",
        EARLY_STOPPING,
        'better = value + self.min_delta if self.goal == "min" else value - self.min_delta',
        "better = value",
    ),
    Mutant(
        "named scalar max summed",
        "named scalars: each by its reduction",
        SCALARS,
        '        elif reduce == "max":\n'
        "            self.values[name] = torch.maximum(self.values[name], value)\n"
        "        else:",
        "        else:",
    ),
    Mutant(
        "named scalars' new names never agreed",
        "named scalars reach the log window",
        METRICS,
        '            scalar_values |= self.agree_on_new_names(total["terms"])',
        "            pass",
    ),
]


# tests that fail with any failing proof: listed after the test of the proof itself
ANY_PROOF = (
    "test_the_proofs_print_a_verdict_per_proof_and_exit_0_when_all_hold",
    "test_a_gradient_off_by_more_than_rounding_fails_its_verdict_with_the_likely_causes",
    "test_a_proof_that_ran_no_step_fails_instead_of_passing_on_nothing",
    "test_the_fsdp_proofs_print_a_verdict_per_proof_and_exit_0_when_all_hold",
)


def failed_tests(report: Path) -> list[str]:
    """The tests a junit report records as failed or in error, the most specific first."""
    if not report.exists():
        return []
    names = []
    for case in ElementTree.parse(report).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            names.append(f"{Path(case.get('classname', '').replace('.', '/')).name}.py::{case.get('name')}")
    return sorted(names, key=lambda name: name.split("::")[-1] in ANY_PROOF)


def run_tests(project: Path, args: list[str], report: Path) -> tuple[int, list[str]]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *args]
    result = subprocess.run(command, cwd=project, capture_output=True, text=True, timeout=1800)
    return result.returncode, failed_tests(report)


def try_mutant(mutant: Mutant, baked: Path, work: Path) -> dict:
    project = work / re.sub(r"[^A-Za-z0-9_.-]+", "-", mutant.name)  # a ':' would split PYTHONPATH
    shutil.copytree(baked, project)
    mutant.apply(project)
    start = time.monotonic()
    code, failed = run_tests(project, [], work / f"{project.name}-fast.xml")
    tier = "fast"
    if not failed and mutant.slow:
        code, failed = run_tests(project, ["--slow", *mutant.slow], work / f"{project.name}-slow.xml")
        tier = "slow"
    if code != 0 and not failed:
        failed = [f"pytest exited {code} without a failed test (collection error?)"]
    shutil.rmtree(project)
    return {"mutant": mutant, "failed": failed, "tier": tier if failed else "-", "seconds": time.monotonic() - start}


def caught_by(failed: list[str]) -> str:
    """The tests of the practice itself; the proofs' summary tests only where nothing else failed."""
    if not failed:
        return "SURVIVED"
    specific = [name for name in failed if name.split("::")[-1] not in ANY_PROOF] or failed
    more = len(failed) - len(specific[:2])
    return "; ".join(specific[:2]) + (f" (+{more} more)" if more else "")


def project(answers: tuple[tuple[str, str], ...]) -> str:
    """The project a mutant's change is made in, in words: its answers besides the defaults."""
    return ", ".join(f"{key}={value}" for key, value in answers) or "defaults"


def bake_with(out: Path, answers: tuple[tuple[str, str], ...]) -> Path:
    from cookiecutter.main import cookiecutter

    return Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(out), extra_context=dict(answers)))


def table(rows: list[dict]) -> str:
    lines = ["| mutant | practice | project | caught by | tier | s |", "|---|---|---|---|---|---|"]
    for row in rows:
        mutant = row["mutant"]
        caught, where = caught_by(row["failed"]), project(mutant.answers)
        cells = [mutant.name, mutant.practice, where, caught, row["tier"], f"{row['seconds']:.0f}"]
        lines.append(f"| {' | '.join(cells)} |")
    caught = sum(bool(row["failed"]) for row in rows)
    return "\n".join([*lines, "", f"score: {caught}/{len(rows)} mutants caught"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these mutants only (names as --list prints)")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--check", action="store_true", help="bake, check that every change applies, and exit")
    parser.add_argument("--keep", type=Path, help="bake into DIR and keep it (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(f"{m.name}: {m.practice} ({m.path})" for m in MUTANTS))
        return 0
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"no mutant named {', '.join(sorted(unknown))}: --list prints their names")
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    work = args.keep or Path(tempfile.mkdtemp(prefix="mutations-"))
    try:
        return score(chosen, work, check_only=args.check)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def score(chosen: list[Mutant], work: Path, check_only: bool) -> int:
    answers = list(dict.fromkeys(mutant.answers for mutant in chosen))  # the projects, defaults first
    baked = {each: bake_with(work / f"baked-{index}", each) for index, each in enumerate(answers)}
    for mutant in chosen:  # every change still applies to the code as baked, before minutes of tests
        mutant.changed((baked[mutant.answers] / mutant.path).read_text())
    if check_only:
        print(f"all {len(chosen)} mutants apply to the baked projects ({'; '.join(map(project, answers))})")
        return 0
    for each, path in baked.items():
        code, failed = run_tests(path, [], work / f"baseline-{path.parent.name}.xml")
        if code != 0:
            print(f"the fast tier of {project(each)} fails before any mutation: {failed}", file=sys.stderr)
            return 2
    rows = []
    for mutant in chosen:
        rows.append(try_mutant(mutant, baked[mutant.answers], work))
        row = rows[-1]
        print(f"{mutant.name}: {caught_by(row['failed'])} ({row['seconds']:.0f} s)", flush=True)
    print(table(rows))
    return 0 if all(row["failed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
